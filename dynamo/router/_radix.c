/*
 * dynamo.router._radix: the prefix tree of KV blocks held by workers (FACTS §3.1) as a native
 * table: the KV router's index (and the worker-local and approximate indexes) stores, removes
 * and matches blocks here.
 *
 * Why native: every KV event a worker publishes is applied to this tree, and every request
 * matches its prompt against it. In Python (path-compressed runs of lists and dicts) applying
 * the events was ~14 % of the offline replay's CPU and the same code indexes live traffic
 * (docs/performance.md, "Offline replay").
 *
 * Layout: one node per block (no path compression: C walks a chain as fast as Python walks a
 * run). A node has its local hash, its parent, its children as a sibling list, and its
 * holders: (slot, external id) pairs. Children are found through one table keyed by
 * (parent, local hash); each slot has a table external id -> node. Ids and hashes are 64-bit:
 * an int in [-2**63, 2**64) (a negative one is remembered as such, so ids come back as given;
 * -1 and 2**64 - 1 name the same block).
 *
 * The contract is ``_radix.pyi``; ``_radix_fallback.py`` is the same in Python (path
 * compressed: ``num_nodes`` counts the runs a fully compressed tree would have, which the
 * fallback matches whenever its runs are fully joined). tests/unit/router/test_radix_native.py
 * holds the two to the same results on random operation sequences.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_id_memo.h"
#include "../_u64.h"
#include "_radix_api.h"

#define MAX_SLOT (1 << 24)

/* ---- nodes ---------------------------------------------------------------------------- */

typedef struct {
    uint32_t slot;
    uint32_t neg; /* the id was given as a negative int */
    uint64_t id;
} Holder;

#define INLINE_HELD 2 /* holders kept in the node itself: most blocks have one or two */

typedef struct Node {
    uint64_t hash;
    struct Node *parent, *kid, *next, *prev; /* first child; siblings */
    uint32_t nkids, nheld, capheld;
    Holder *held;            /* inl, or a heap array once more than INLINE_HELD hold it */
    Holder inl[INLINE_HELD];
} Node;

/* ---- hash tables (open addressing, linear probing, backward-shift deletion) ------------ */

static inline uint64_t
mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* external id -> node (node NULL: empty) */
typedef struct {
    uint64_t key;
    Node *node;
} IdEntry;

typedef struct {
    IdEntry *e;
    size_t mask, size; /* capacity = mask + 1 (a power of two, or 0) */
} IdMap;

static Node *
idmap_get(const IdMap *m, uint64_t key)
{
    if (m->e == NULL)
        return NULL;
    size_t i = (size_t)mix64(key) & m->mask;
    for (;;) {
        IdEntry *e = &m->e[i];
        if (e->node == NULL)
            return NULL;
        if (e->key == key)
            return e->node;
        i = (i + 1) & m->mask;
    }
}

static int
idmap_grow(IdMap *m)
{
    size_t cap = m->e ? (m->mask + 1) * 2 : 16;
    IdEntry *e = PyMem_Calloc(cap, sizeof(IdEntry));
    if (e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (m->e) {
        for (size_t j = 0; j <= m->mask; j++) {
            if (m->e[j].node == NULL)
                continue;
            size_t i = (size_t)mix64(m->e[j].key) & (cap - 1);
            while (e[i].node != NULL)
                i = (i + 1) & (cap - 1);
            e[i] = m->e[j];
        }
        PyMem_Free(m->e);
    }
    m->e = e;
    m->mask = cap - 1;
    return 0;
}

/* Insert or overwrite. */
static int
idmap_put(IdMap *m, uint64_t key, Node *node)
{
    if (m->e == NULL || (m->size + 1) * 4 > (m->mask + 1) * 3) {
        if (idmap_grow(m) < 0)
            return -1;
    }
    size_t i = (size_t)mix64(key) & m->mask;
    for (;;) {
        IdEntry *e = &m->e[i];
        if (e->node == NULL) {
            e->key = key;
            e->node = node;
            m->size++;
            return 0;
        }
        if (e->key == key) {
            e->node = node;
            return 0;
        }
        i = (i + 1) & m->mask;
    }
}

static void
idmap_del(IdMap *m, uint64_t key)
{
    if (m->e == NULL)
        return;
    size_t mask = m->mask, i = (size_t)mix64(key) & mask;
    for (;;) {
        if (m->e[i].node == NULL)
            return;
        if (m->e[i].key == key)
            break;
        i = (i + 1) & mask;
    }
    /* backward shift: pull later entries of the probe chain into the hole */
    size_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (m->e[j].node == NULL)
            break;
        size_t home = (size_t)mix64(m->e[j].key) & mask;
        /* the entry at j may move to the hole if its home is not in (hole, j] cyclically */
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            m->e[hole] = m->e[j];
            hole = j;
        }
    }
    m->e[hole].node = NULL;
    m->size--;
}

/* (parent, local hash) -> child: a table of nodes, keyed by their own parent and hash */
typedef struct {
    Node **e;
    size_t mask, size;
} KidMap;

static inline size_t
kid_home(const Node *parent, uint64_t hash, size_t mask)
{
    return (size_t)mix64(hash ^ ((uint64_t)(uintptr_t)parent * 0x9E3779B97F4A7C15ULL)) & mask;
}

static Node *
kidmap_get(const KidMap *m, const Node *parent, uint64_t hash)
{
    if (m->e == NULL)
        return NULL;
    size_t i = kid_home(parent, hash, m->mask);
    for (;;) {
        Node *n = m->e[i];
        if (n == NULL)
            return NULL;
        if (n->hash == hash && n->parent == parent)
            return n;
        i = (i + 1) & m->mask;
    }
}

static int
kidmap_grow(KidMap *m)
{
    size_t cap = m->e ? (m->mask + 1) * 2 : 64;
    Node **e = PyMem_Calloc(cap, sizeof(Node *));
    if (e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (m->e) {
        for (size_t j = 0; j <= m->mask; j++) {
            Node *n = m->e[j];
            if (n == NULL)
                continue;
            size_t i = kid_home(n->parent, n->hash, cap - 1);
            while (e[i] != NULL)
                i = (i + 1) & (cap - 1);
            e[i] = n;
        }
        PyMem_Free(m->e);
    }
    m->e = e;
    m->mask = cap - 1;
    return 0;
}

/* n (its parent and hash set) must not be in the table yet */
static int
kidmap_add(KidMap *m, Node *n)
{
    if (m->e == NULL || (m->size + 1) * 4 > (m->mask + 1) * 3) {
        if (kidmap_grow(m) < 0)
            return -1;
    }
    size_t i = kid_home(n->parent, n->hash, m->mask);
    while (m->e[i] != NULL)
        i = (i + 1) & m->mask;
    m->e[i] = n;
    m->size++;
    return 0;
}

static void
kidmap_del(KidMap *m, const Node *n)
{
    size_t mask = m->mask, i = kid_home(n->parent, n->hash, mask);
    while (m->e[i] != n) {
        if (m->e[i] == NULL)
            return;
        i = (i + 1) & mask;
    }
    size_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & mask;
        Node *x = m->e[j];
        if (x == NULL)
            break;
        size_t home = kid_home(x->parent, x->hash, mask);
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            m->e[hole] = x;
            hole = j;
        }
    }
    m->e[hole] = NULL;
    m->size--;
}

/* ---- the tree ------------------------------------------------------------------------- */

typedef struct {
    IdMap ids;
} Slot;

/* find_matches' recent queries' keys, by their leading hash objects (``dynamo/_id_memo.h``:
 * the offline replay's prompts of a prefix group share ~64 of their ~72 hash objects), one memo
 * a tree. */
#define MEMO_BITS 5

typedef struct {
    PyObject_HEAD
    Node root;
    KidMap kids;
    Slot **slots; /* by slot number; NULL: never used or cleared */
    uint32_t nslots;
    uint32_t *mark; /* per slot, for find_matches */
    uint32_t gen;
    Py_ssize_t blocks;
    Node *spare; /* freed nodes for reuse, linked by next (node_new, node_free) */
    size_t nspare;
    IdMemo memo[1 << MEMO_BITS]; /* find_matches' recent queries */
    /* scratch stacks, reused */
    Node **stack, **seen;
    size_t stack_cap, seen_cap;
} Tree;

static int
holder_find(const Node *n, uint32_t slot)
{
    for (uint32_t i = 0; i < n->nheld; i++)
        if (n->held[i].slot == slot)
            return (int)i;
    return -1;
}

static int
holder_add(Node *n, uint32_t slot, uint64_t id, int neg)
{
    if (n->nheld == n->capheld) {
        uint32_t cap = n->capheld * 2;
        Holder *h = n->held == n->inl ? PyMem_Malloc(cap * sizeof(Holder))
                                      : PyMem_Realloc(n->held, cap * sizeof(Holder));
        if (h == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (n->held == n->inl)
            memcpy(h, n->inl, n->nheld * sizeof(Holder));
        n->held = h;
        n->capheld = cap;
    }
    n->held[n->nheld++] = (Holder){slot, (uint32_t)neg, id};
    return 0;
}

/* A node's memory back to the allocator (its holders' array too, if on the heap). */
static void
node_release(Node *n)
{
    if (n->held != n->inl)
        PyMem_Free(n->held);
    PyMem_Free(n);
}

/* Freed nodes are kept for the next ones (up to MAX_SPARE): a pass stores about as many blocks
 * as it evicts, and a node's allocation and its free were a third of a stored block's cost. A
 * spare node keeps its holders' storage (emptied). */
#define MAX_SPARE 4096

static Node *
node_new(Tree *t, Node *parent, uint64_t hash)
{
    Node *n = t->spare;
    if (n != NULL) {
        t->spare = n->next;
        t->nspare--;
    }
    else {
        if ((n = PyMem_Malloc(sizeof(Node))) == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        n->held = n->inl;
        n->capheld = INLINE_HELD;
    }
    n->hash = hash;
    n->parent = parent;
    n->kid = n->prev = NULL;
    n->nkids = n->nheld = 0;
    if (kidmap_add(&t->kids, n) < 0) {
        node_release(n);
        return NULL;
    }
    n->next = parent->kid;
    if (parent->kid)
        parent->kid->prev = n;
    parent->kid = n;
    parent->nkids++;
    t->blocks++;
    return n;
}

/* The child of node with local hash h, or NULL. A node with few children (most: a chain's
 * blocks have one) is read through its sibling list, which the walk touches anyway; the table
 * probe (a mix and a random read) is for wide nodes (the root, a prefix's fork). */
#define FEW_KIDS 2

static inline Node *
child_of(const Tree *t, const Node *node, uint64_t h)
{
    if (node->nkids <= FEW_KIDS) {
        for (Node *c = node->kid; c; c = c->next)
            if (c->hash == h)
                return c;
        return NULL;
    }
    return kidmap_get(&t->kids, node, h);
}

/* n has no holders and no children */
static void
node_free(Tree *t, Node *n)
{
    kidmap_del(&t->kids, n);
    Node *p = n->parent;
    if (n->prev)
        n->prev->next = n->next;
    else
        p->kid = n->next;
    if (n->next)
        n->next->prev = n->prev;
    p->nkids--;
    t->blocks--;
    if (t->nspare < MAX_SPARE) {
        n->nheld = 0;
        n->next = t->spare;
        t->spare = n;
        t->nspare++;
    }
    else
        node_release(n);
}

static int
push(Node ***arr, size_t *cap, size_t len, Node *n)
{
    if (len == *cap) {
        size_t c = *cap ? *cap * 2 : 64;
        Node **a = PyMem_Realloc(*arr, c * sizeof(Node *));
        if (a == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *arr = a;
        *cap = c;
    }
    (*arr)[len] = n;
    return 0;
}

/* an int as a 64-bit key: [-2**63, 2**64); *neg set when negative */
static int as_key_slow(PyObject *obj, uint64_t *key, int *neg);

/* inline at its callers: the find walk converts ~70 hashes a request */
static inline int
as_key(PyObject *obj, uint64_t *key, int *neg)
{
    if (dyn_u64_digits(obj, key)) { /* the common case: a non-negative 64-bit int */
        *neg = 0;
        return 0;
    }
    return as_key_slow(obj, key, neg);
}

static Py_NO_INLINE int
as_key_slow(PyObject *obj, uint64_t *key, int *neg)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "block ids and hashes must be ints, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred())
            return -1;
        *key = (uint64_t)v;
        *neg = v < 0;
        return 0;
    }
    if (overflow > 0) {
        unsigned long long u = DYN_AS_U64(obj);
        if (u == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        *key = (uint64_t)u;
        *neg = 0;
        return 0;
    }
    PyErr_SetString(PyExc_OverflowError, "block ids and hashes must fit 64 bits");
    return -1;
}

static PyObject *
key_obj(uint64_t key, int neg)
{
    return neg ? PyLong_FromLongLong((long long)key) : PyLong_FromUnsignedLongLong(key);
}

static int
as_slot(PyObject *obj, uint32_t *slot)
{
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v >= MAX_SLOT) {
        PyErr_Format(PyExc_ValueError, "slot must be in [0, %d), got %ld", MAX_SLOT, v);
        return -1;
    }
    *slot = (uint32_t)v;
    return 0;
}

static Slot *
slot_get(Tree *t, uint32_t s)
{
    return s < t->nslots ? t->slots[s] : NULL;
}

static Slot *
slot_make(Tree *t, uint32_t s)
{
    if (s >= t->nslots) {
        uint32_t n = t->nslots ? t->nslots : 8;
        while (n <= s)
            n *= 2;
        Slot **a = PyMem_Realloc(t->slots, n * sizeof(Slot *));
        if (a == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        uint32_t *mk = PyMem_Realloc(t->mark, n * sizeof(uint32_t));
        if (mk == NULL) {
            t->slots = a; /* keep the grown array; nslots unchanged */
            PyErr_NoMemory();
            return NULL;
        }
        memset(a + t->nslots, 0, (n - t->nslots) * sizeof(Slot *));
        memset(mk + t->nslots, 0, (n - t->nslots) * sizeof(uint32_t));
        t->slots = a;
        t->mark = mk;
        t->nslots = n;
    }
    if (t->slots[s] == NULL) {
        t->slots[s] = PyMem_Calloc(1, sizeof(Slot));
        if (t->slots[s] == NULL)
            PyErr_NoMemory();
    }
    return t->slots[s];
}

/* Ids the slot lost, collected while the tree changes and handed to Python afterwards. */
typedef struct {
    Holder *h;
    size_t len, cap;
    int failed;
} Lost;

static void
lost_add(Lost *l, Holder h)
{
    if (l == NULL || l->failed)
        return;
    if (l->len == l->cap) {
        size_t c = l->cap ? l->cap * 2 : 64;
        Holder *a = PyMem_Realloc(l->h, c * sizeof(Holder));
        if (a == NULL) {
            l->failed = 1;
            return;
        }
        l->h = a;
        l->cap = c;
    }
    l->h[l->len++] = h;
}

/* The slot lets go of node top and every descendant it holds; nodes nobody holds are freed. */
static int
detach(Tree *t, Slot *sl, uint32_t slot, Node *top, Lost *lost)
{
    size_t sp = 0, ns = 0;
    if (push(&t->stack, &t->stack_cap, sp++, top) < 0)
        return -1;
    while (sp) {
        Node *n = t->stack[--sp];
        int i = holder_find(n, slot);
        if (i < 0)
            continue; /* unreachable: only held children are pushed */
        Holder h = n->held[i];
        n->held[i] = n->held[--n->nheld];
        idmap_del(&sl->ids, h.id);
        lost_add(lost, h);
        if (push(&t->seen, &t->seen_cap, ns++, n) < 0)
            return -1;
        for (Node *c = n->kid; c; c = c->next) {
            if (holder_find(c, slot) >= 0 && push(&t->stack, &t->stack_cap, sp++, c) < 0)
                return -1;
        }
    }
    /* children were seen after their parents: free in reverse, leaves first */
    while (ns) {
        Node *n = t->seen[--ns];
        if (n->nheld == 0)
            node_free(t, n);
    }
    return 0;
}

static int
remove_id(Tree *t, Slot *sl, uint32_t slot, uint64_t id, Lost *lost)
{
    Node *n = idmap_get(&sl->ids, id);
    if (n == NULL)
        return 0;
    if (n->nkids == 0) { /* a leaf (most evictions): detach's walk without its stacks */
        int i = holder_find(n, slot);
        Holder h = n->held[i]; /* the slot holds it: its id maps here */
        n->held[i] = n->held[--n->nheld];
        idmap_del(&sl->ids, id);
        lost_add(lost, h);
        if (n->nheld == 0)
            node_free(t, n);
        return 1;
    }
    return detach(t, sl, slot, n, lost) < 0 ? -1 : 1;
}

/* Store id b for the block with local hash h below node (which the slot holds, or the root). */
static Node *
extend_one(Tree *t, Slot *sl, uint32_t slot, Node *node, uint64_t b, int neg, uint64_t h)
{
    Node *c = child_of(t, node, h);
    if (c == NULL) {
        c = node_new(t, node, h);
        if (c == NULL)
            return NULL;
        if (holder_add(c, slot, b, neg) < 0) {
            node_free(t, c);
            return NULL;
        }
    }
    else {
        int i = holder_find(c, slot);
        if (i >= 0) { /* a new id for a block the slot holds: the old one is dropped */
            idmap_del(&sl->ids, c->held[i].id);
            c->held[i].id = b;
            c->held[i].neg = (uint32_t)neg;
        }
        else if (holder_add(c, slot, b, neg) < 0)
            return NULL;
    }
    if (idmap_put(&sl->ids, b, c) < 0)
        return NULL;
    return c;
}

/* Keys of a sequence of ints (a fresh buffer, or NULL with an error set). */
static uint64_t *
keys_of(PyObject *seq, Py_ssize_t n, uint8_t *negs)
{
    uint64_t *out = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int neg;
        if (as_key(items[i], &out[i], &neg) < 0) {
            PyMem_Free(out);
            return NULL;
        }
        if (negs)
            negs[i] = (uint8_t)neg;
    }
    return out;
}

/* Store the chain (ids bl[i * stride], given negative where bneg[i] (NULL: none), local
 * hashes hl[i * stride]) under the parent id (none: the root): 1 stored, 0 the parent is
 * unknown or was lost (see store_hashes), -1 error. */
static int
store_chain(Tree *t, uint32_t slot, int has_parent, uint64_t parent, const uint64_t *bl,
            const uint8_t *bneg, const uint64_t *hl, Py_ssize_t n, Py_ssize_t stride)
{
    Slot *sl = slot_make(t, slot);
    if (sl == NULL)
        return -1;
    Node *node = &t->root;
    int has_cur = has_parent;
    uint64_t cur = parent;
    if (has_parent) {
        node = idmap_get(&sl->ids, cur);
        if (node == NULL)
            return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t b = bl[i * stride], h = hl[i * stride];
        Node *at = idmap_get(&sl->ids, b);
        if (at != NULL) {
            if (at->parent == node && at->hash == h) { /* already stored with this id */
                node = at;
                cur = b;
                has_cur = 1;
                continue;
            }
            /* the id names another block: drop it there (with its descendants) first */
            if (detach(t, sl, slot, at, NULL) < 0)
                return -1;
            if (has_cur) { /* our position may have been dropped with it */
                node = idmap_get(&sl->ids, cur);
                if (node == NULL)
                    return 0;
            }
        }
        node = extend_one(t, sl, slot, node, b, bneg ? bneg[i] : 0, h);
        if (node == NULL)
            return -1;
        cur = b;
        has_cur = 1;
    }
    return 1;
}

static PyObject *
store_keys(Tree *t, uint32_t slot, PyObject *parent, const uint64_t *bl, const uint8_t *bneg,
           const uint64_t *hl, Py_ssize_t n)
{
    uint64_t cur = 0;
    int neg;
    if (parent != Py_None && as_key(parent, &cur, &neg) < 0)
        return NULL;
    int rc = store_chain(t, slot, parent != Py_None, cur, bl, bneg, hl, n, 1);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyObject *
Tree_store_hashes(Tree *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "store_hashes(slot, parent_hash, block_hashes, local_hashes)");
        return NULL;
    }
    uint32_t slot;
    if (as_slot(args[0], &slot) < 0)
        return NULL;
    PyObject *bs = PySequence_Fast(args[2], "block_hashes must be a sequence of ints");
    if (bs == NULL)
        return NULL;
    PyObject *hs = PySequence_Fast(args[3], "local_hashes must be a sequence of ints");
    if (hs == NULL) {
        Py_DECREF(bs);
        return NULL;
    }
    PyObject *res = NULL;
    uint64_t *bl = NULL, *hl = NULL;
    uint8_t *negs = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(bs);
    if (PySequence_Fast_GET_SIZE(hs) != n) {
        PyErr_SetString(PyExc_ValueError, "block_hashes and local_hashes differ in length");
        goto done;
    }
    negs = PyMem_Malloc((size_t)(n ? n : 1));
    if (negs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    bl = keys_of(bs, n, negs);
    if (bl == NULL)
        goto done;
    hl = keys_of(hs, n, NULL);
    if (hl == NULL)
        goto done;
    res = store_keys(t, slot, args[1], bl, negs, hl, n);
done:
    PyMem_Free(bl);
    PyMem_Free(hl);
    PyMem_Free(negs);
    Py_DECREF(bs);
    Py_DECREF(hs);
    return res;
}

static PyObject *str_block_hash, *str_tokens_hash;

static PyObject *
Tree_store(Tree *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "store(slot, parent_hash, blocks)");
        return NULL;
    }
    uint32_t slot;
    if (as_slot(args[0], &slot) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[2], "blocks must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *res = NULL;
    uint64_t *bl = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    uint64_t *hl = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    uint8_t *negs = PyMem_Malloc((size_t)(n ? n : 1));
    if (bl == NULL || hl == NULL || negs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int neg, hneg;
        PyObject *b = PyObject_GetAttr(items[i], str_block_hash);
        if (b == NULL)
            goto done;
        int rc = as_key(b, &bl[i], &neg);
        Py_DECREF(b);
        if (rc < 0)
            goto done;
        negs[i] = (uint8_t)neg;
        PyObject *h = PyObject_GetAttr(items[i], str_tokens_hash);
        if (h == NULL)
            goto done;
        rc = as_key(h, &hl[i], &hneg);
        Py_DECREF(h);
        if (rc < 0)
            goto done;
    }
    res = store_keys(t, slot, args[1], bl, negs, hl, n);
done:
    PyMem_Free(bl);
    PyMem_Free(hl);
    PyMem_Free(negs);
    Py_DECREF(seq);
    return res;
}

static PyObject *
Tree_remove(Tree *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"slot", "block_hashes", "removed", NULL};
    PyObject *slot_obj, *hashes, *removed = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O:remove", kwlist, &slot_obj, &hashes,
                                     &removed))
        return NULL;
    uint32_t slot;
    if (as_slot(slot_obj, &slot) < 0)
        return NULL;
    if (removed != Py_None && !PyList_Check(removed)) {
        PyErr_SetString(PyExc_TypeError, "removed must be a list or None");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(hashes, "block_hashes must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), unknown = 0;
    Slot *sl = slot_get(t, slot);
    if (sl == NULL) {
        Py_DECREF(seq);
        return PyLong_FromSsize_t(n);
    }
    uint64_t *keys = keys_of(seq, n, NULL);
    Py_DECREF(seq);
    if (keys == NULL)
        return NULL;
    Lost lost = {NULL, 0, 0, 0};
    Lost *lp = removed != Py_None ? &lost : NULL;
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc >= 0; i++) {
        rc = remove_id(t, sl, slot, keys[i], lp);
        if (rc == 0)
            unknown++;
    }
    PyMem_Free(keys);
    PyObject *res = NULL;
    if (rc < 0)
        goto done;
    if (lost.failed) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < lost.len; i++) {
        PyObject *x = key_obj(lost.h[i].id, (int)lost.h[i].neg);
        if (x == NULL || PyList_Append(removed, x) < 0) {
            Py_XDECREF(x);
            goto done;
        }
        Py_DECREF(x);
    }
    res = PyLong_FromSsize_t(unknown);
done:
    PyMem_Free(lost.h);
    return res;
}

/* ---- a pass's events in the raw form (dynamo/protocol/kv_raw.py: the layout) ------------ */

enum { RAW_STORED = 1, RAW_REMOVED = 2, RAW_HAS_PARENT = 4, RAW_NEG = 8, RAW_HEADER = 3 };

/* The values of the event whose head is w[at] and the place after it; -1 if malformed. */
static Py_ssize_t
raw_event_end(const uint64_t *w, Py_ssize_t nw, Py_ssize_t at, Py_ssize_t *nvalues)
{
    if (at >= nw)
        return -1;
    uint64_t head = w[at], kind = head & 3, n = head >> 8;
    if ((kind != RAW_STORED && kind != RAW_REMOVED) || n > (uint64_t)nw)
        return -1;
    *nvalues = (Py_ssize_t)(kind == RAW_REMOVED ? n : 2 * n + ((head & RAW_HAS_PARENT) ? 1 : 0));
    Py_ssize_t end = at + 1 + *nvalues + ((head & RAW_NEG) ? *nvalues : 0);
    return end > nw ? -1 : end;
}

/* One raw event applied to the slot: 1 applied, 0 its parent or a removed id was unknown. */
static int
raw_apply_one(Tree *t, uint32_t slot, const uint64_t *w, Py_ssize_t nvalues)
{
    uint64_t head = w[0], n = head >> 8;
    const uint64_t *vals = w + 1, *flags = (head & RAW_NEG) ? w + 1 + nvalues : NULL;
    if ((head & 3) == RAW_REMOVED) {
        Slot *sl = slot_get(t, slot);
        if (sl == NULL)
            return n == 0;
        int all = 1;
        for (uint64_t k = 0; k < n; k++) {
            int rc = remove_id(t, sl, slot, vals[k], NULL);
            if (rc < 0)
                return -1;
            all &= rc;
        }
        return all;
    }
    int has_parent = (head & RAW_HAS_PARENT) != 0;
    const uint64_t *blocks = vals + has_parent;
    uint8_t *negs = NULL;
    if (flags != NULL) {
        if ((negs = PyMem_Malloc(n ? n : 1)) == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (uint64_t k = 0; k < n; k++)
            negs[k] = flags[has_parent + 2 * k] != 0;
    }
    int rc = store_chain(t, slot, has_parent, has_parent ? vals[0] : 0, blocks, negs, blocks + 1,
                         (Py_ssize_t)n, 2);
    PyMem_Free(negs);
    return rc;
}

/* (a, b, c) as a tuple of ints (built directly: Py_BuildValue parses its format each time) */
static PyObject *
three_counts(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c)
{
    PyObject *t = PyTuple_New(3);
    Py_ssize_t v[3] = {a, b, c};
    for (int i = 0; t != NULL && i < 3; i++) {
        PyObject *x = PyLong_FromSsize_t(v[i]);
        if (x == NULL)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* apply_raw(slot, raw) into counts (ok, parent, block): the method and the capsule's call */
static int
apply_raw(PyObject *tree, PyObject *slot_obj, PyObject *raw, Py_ssize_t counts[3])
{
    Tree *t = (Tree *)tree;
    uint32_t slot;
    if (as_slot(slot_obj, &slot) < 0)
        return -1;
    if (!PyBytes_Check(raw)) {
        PyErr_SetString(PyExc_TypeError, "raw events are bytes");
        return -1;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(raw), nw = len / 8, ok = 0, parent = 0, block = 0;
    counts[0] = counts[1] = counts[2] = 0;
    if (len == 0)
        return 0;
    /* a bytes object's data follows its 32-byte header: 8-byte aligned */
    const uint64_t *w = (const uint64_t *)PyBytes_AS_STRING(raw);
    Py_ssize_t at = RAW_HEADER, nvalues;
    uint64_t count = nw >= RAW_HEADER ? w[2] : 0;
    for (uint64_t i = 0; i < count && at >= 0; i++) /* checked whole before any change */
        at = raw_event_end(w, nw, at, &nvalues);
    if (len % 8 || nw < RAW_HEADER || at != nw) {
        PyErr_SetString(PyExc_ValueError, "malformed raw events");
        return -1;
    }
    at = RAW_HEADER;
    int rc = 0;
    for (uint64_t i = 0; i < count; i++) {
        Py_ssize_t end = raw_event_end(w, nw, at, &nvalues);
        if ((rc = raw_apply_one(t, slot, w + at, nvalues)) < 0)
            break; /* what was applied is counted */
        if (rc)
            ok++;
        else if ((w[at] & 3) == RAW_STORED)
            parent++;
        else
            block++;
        at = end;
    }
    counts[0] = ok;
    counts[1] = parent;
    counts[2] = block;
    return rc < 0 ? -1 : 0;
}

static PyObject *
Tree_apply_raw(Tree *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "apply_raw(slot, raw)");
        return NULL;
    }
    Py_ssize_t counts[3];
    if (apply_raw((PyObject *)t, args[0], args[1], counts) < 0)
        return NULL;
    return three_counts(counts[0], counts[1], counts[2]);
}

static void
clear_slot(Tree *t, uint32_t slot)
{
    Slot *sl = slot_get(t, slot);
    if (sl == NULL)
        return;
    Node *c = t->root.kid;
    while (c) {
        Node *nxt = c->next; /* c may be freed */
        if (holder_find(c, slot) >= 0 && detach(t, sl, slot, c, NULL) < 0) {
            PyErr_Clear(); /* out of memory in a scratch stack: leave the rest */
            return;
        }
        c = nxt;
    }
    PyMem_Free(sl->ids.e);
    PyMem_Free(sl);
    t->slots[slot] = NULL;
}

static PyObject *
Tree_clear(Tree *t, PyObject *arg)
{
    uint32_t slot;
    if (as_slot(arg, &slot) < 0)
        return NULL;
    clear_slot(t, slot);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Tree_find_matches(Tree *t, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "local_hashes must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    PyObject *scores = PyDict_New();
    if (scores == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    Node *node = &t->root, *prev = NULL;
    Py_ssize_t i = 0;
    /* the memo's keys for the leading `same` items; the keys converted from there on are written
     * to it (`known`: up to where), and the items with them when the walk ends */
    IdMemo *m = n > 0 ? id_memo_way(t->memo, MEMO_BITS, items[0]) : NULL;
    Py_ssize_t same = 0, known = 0;
    int writable = 0;
    if (m != NULL) {
        same = id_memo_same(m, items, n);
        writable = id_memo_reserve(m, n) == 0;
    }
    for (; i < n; i++) {
        uint64_t h;
        if (i < same)
            h = m->keys[i];
        else {
            int neg;
            if (as_key(items[i], &h, &neg) < 0) {
                if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                    goto fail;
                PyErr_Clear(); /* no block has this hash */
                break;
            }
            if (writable) {
                m->keys[i] = h;
                known = i + 1;
            }
        }
        Node *c = child_of(t, node, h);
        if (c == NULL)
            break;
        /* holders only shrink along a path: equal counts mean equal sets */
        if (prev != NULL && c->nheld != prev->nheld) {
            uint32_t g = ++t->gen;
            if (g == 0) { /* wrapped: no stale mark may equal a new generation */
                memset(t->mark, 0, t->nslots * sizeof(uint32_t));
                g = t->gen = 1;
            }
            for (uint32_t k = 0; k < c->nheld; k++)
                t->mark[c->held[k].slot] = g;
            for (uint32_t k = 0; k < prev->nheld; k++) {
                uint32_t s = prev->held[k].slot;
                if (t->mark[s] == g)
                    continue;
                PyObject *key = PyLong_FromUnsignedLong(s), *val = PyLong_FromSsize_t(i);
                int rc = (key && val) ? PyDict_SetItem(scores, key, val) : -1;
                Py_XDECREF(key);
                Py_XDECREF(val);
                if (rc < 0)
                    goto fail;
            }
        }
        prev = node = c;
    }
    if (prev != NULL) {
        PyObject *val = PyLong_FromSsize_t(i);
        if (val == NULL)
            goto fail;
        for (uint32_t k = 0; k < prev->nheld; k++) {
            PyObject *key = PyLong_FromUnsignedLong(prev->held[k].slot);
            int rc = key ? PyDict_SetItem(scores, key, val) : -1;
            Py_XDECREF(key);
            if (rc < 0) {
                Py_DECREF(val);
                goto fail;
            }
        }
        Py_DECREF(val);
    }
    if (m != NULL) /* the query becomes the memo (a prefix group's next one shares it) */
        id_memo_adopt(m, items, same, known);
    Py_DECREF(seq);
    return scores;
fail:
    if (m != NULL)
        id_memo_truncate(m, same); /* the keys past it may have been overwritten */
    Py_DECREF(seq);
    Py_DECREF(scores);
    return NULL;
}

static PyObject *
Tree_num_blocks(Tree *t, PyObject *arg)
{
    uint32_t slot;
    if (as_slot(arg, &slot) < 0)
        return NULL;
    Slot *sl = slot_get(t, slot);
    return PyLong_FromSize_t(sl ? sl->ids.size : 0);
}

static PyObject *
Tree_holds(Tree *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "holds(slot, block_hash)");
        return NULL;
    }
    uint32_t slot;
    uint64_t key;
    int neg;
    if (as_slot(args[0], &slot) < 0)
        return NULL;
    if (as_key(args[1], &key, &neg) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    Slot *sl = slot_get(t, slot);
    return PyBool_FromLong(sl != NULL && idmap_get(&sl->ids, key) != NULL);
}

static PyObject *
Tree_digest(Tree *t, PyObject *arg)
{
    uint32_t slot;
    if (as_slot(arg, &slot) < 0)
        return NULL;
    Slot *sl = slot_get(t, slot);
    uint64_t total = 0;
    size_t count = 0;
    if (sl != NULL && sl->ids.e != NULL) {
        for (size_t j = 0; j <= sl->ids.mask; j++) {
            Node *n = sl->ids.e[j].node;
            if (n == NULL)
                continue;
            uint64_t h = sl->ids.e[j].key;
            int i = holder_find(n, slot);
            int neg = i >= 0 && n->held[i].neg;
            /* Python's h ^ (h >> 31) on the int as given (an arithmetic shift if negative) */
            uint64_t shifted = neg ? (uint64_t)((int64_t)h >> 31) : h >> 31;
            total += (h ^ shifted) * 0x9E3779B97F4A7C15ULL;
            count++;
        }
    }
    return Py_BuildValue("(nK)", (Py_ssize_t)count, (unsigned long long)total);
}

static PyObject *
Tree_slots(Tree *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (uint32_t s = 0; s < t->nslots; s++) {
        if (t->slots[s] == NULL || t->slots[s]->ids.size == 0)
            continue;
        PyObject *x = PyLong_FromUnsignedLong(s);
        if (x == NULL || PyList_Append(out, x) < 0) {
            Py_XDECREF(x);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(x);
    }
    return out;
}

static PyObject *kv_events_module;

/* The slot's blocks as BlocksStored events, parents first, one per chain. */
static PyObject *
Tree_dump(Tree *t, PyObject *arg)
{
    uint32_t slot;
    if (as_slot(arg, &slot) < 0)
        return NULL;
    if (kv_events_module == NULL) {
        kv_events_module = PyImport_ImportModule("dynamo.protocol.kv_events");
        if (kv_events_module == NULL)
            return NULL;
    }
    PyObject *out = PyList_New(0), *stored_cls = NULL, *block_cls = NULL, *kwargs = NULL;
    PyObject *empty = NULL, *blocks = NULL;
    if (out == NULL)
        return NULL;
    stored_cls = PyObject_GetAttrString(kv_events_module, "BlocksStored");
    block_cls = PyObject_GetAttrString(kv_events_module, "StoredBlock");
    empty = PyTuple_New(0);
    if (stored_cls == NULL || block_cls == NULL || empty == NULL)
        goto fail;
    size_t sp = 0;
    for (Node *c = t->root.kid; c; c = c->next)
        if (holder_find(c, slot) >= 0 && push(&t->stack, &t->stack_cap, sp++, c) < 0)
            goto fail;
    while (sp) {
        Node *n = t->stack[--sp];
        PyObject *parent = Py_None;
        Py_INCREF(parent);
        if (n->parent != &t->root) {
            const Holder *ph = &n->parent->held[holder_find(n->parent, slot)];
            Py_DECREF(parent);
            parent = key_obj(ph->id, (int)ph->neg);
            if (parent == NULL)
                goto fail;
        }
        blocks = PyList_New(0);
        if (blocks == NULL) {
            Py_DECREF(parent);
            goto fail;
        }
        for (;;) { /* the chain: while exactly one child is held */
            const Holder *h = &n->held[holder_find(n, slot)];
            PyObject *b = key_obj(h->id, (int)h->neg);
            PyObject *th = PyLong_FromUnsignedLongLong(n->hash);
            PyObject *blk = (b && th) ? PyObject_CallFunctionObjArgs(block_cls, b, th, NULL)
                                      : NULL;
            Py_XDECREF(b);
            Py_XDECREF(th);
            if (blk == NULL || PyList_Append(blocks, blk) < 0) {
                Py_XDECREF(blk);
                Py_DECREF(parent);
                goto fail;
            }
            Py_DECREF(blk);
            Node *only = NULL;
            uint32_t held_kids = 0;
            for (Node *c = n->kid; c; c = c->next)
                if (holder_find(c, slot) >= 0) {
                    held_kids++;
                    only = c;
                }
            if (held_kids == 1) {
                n = only;
                continue;
            }
            for (Node *c = n->kid; c; c = c->next)
                if (holder_find(c, slot) >= 0 && push(&t->stack, &t->stack_cap, sp++, c) < 0) {
                    Py_DECREF(parent);
                    goto fail;
                }
            break;
        }
        kwargs = Py_BuildValue("{sNsO}", "parent_hash", parent, "blocks", blocks);
        if (kwargs == NULL)
            goto fail;
        PyObject *ev = PyObject_Call(stored_cls, empty, kwargs);
        Py_CLEAR(kwargs);
        Py_CLEAR(blocks);
        if (ev == NULL || PyList_Append(out, ev) < 0) {
            Py_XDECREF(ev);
            goto fail;
        }
        Py_DECREF(ev);
    }
    Py_DECREF(stored_cls);
    Py_DECREF(block_cls);
    Py_DECREF(empty);
    return out;
fail:
    Py_XDECREF(blocks);
    Py_XDECREF(kwargs);
    Py_XDECREF(stored_cls);
    Py_XDECREF(block_cls);
    Py_XDECREF(empty);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
invariant(const char *msg)
{
    PyErr_SetString(PyExc_AssertionError, msg);
    return NULL;
}

static PyObject *
Tree_check_invariants(Tree *t, PyObject *Py_UNUSED(ignored))
{
    size_t *held_count = PyMem_Calloc(t->nslots ? t->nslots : 1, sizeof(size_t));
    if (held_count == NULL)
        return PyErr_NoMemory();
    PyObject *res = NULL;
    Py_ssize_t nodes = 0;
    size_t sp = 0;
    if (push(&t->stack, &t->stack_cap, sp++, &t->root) < 0)
        goto done;
    while (sp) {
        Node *n = t->stack[--sp];
        uint32_t kids = 0;
        for (Node *c = n->kid; c; c = c->next) {
            kids++;
            if (c->parent != n || (c->next && c->next->prev != c) ||
                kidmap_get(&t->kids, n, c->hash) != c) {
                invariant("child mislinked");
                goto done;
            }
            if (push(&t->stack, &t->stack_cap, sp++, c) < 0)
                goto done;
        }
        if (kids != n->nkids) {
            invariant("child count wrong");
            goto done;
        }
        if (n == &t->root)
            continue;
        nodes++;
        if (n->nheld == 0) {
            invariant("block held by nobody");
            goto done;
        }
        for (uint32_t k = 0; k < n->nheld; k++) {
            uint32_t s = n->held[k].slot;
            Slot *sl = slot_get(t, s);
            if (holder_find(n, s) != (int)k) {
                invariant("slot holds a block twice");
                goto done;
            }
            if (n->parent != &t->root && holder_find(n->parent, s) < 0) {
                invariant("slot holds a block but not its parent");
                goto done;
            }
            if (sl == NULL || idmap_get(&sl->ids, n->held[k].id) != n) {
                invariant("slot lookup disagrees with a block");
                goto done;
            }
            held_count[s]++;
        }
    }
    if (nodes != t->blocks || (size_t)nodes != t->kids.size) {
        invariant("block count wrong");
        goto done;
    }
    for (uint32_t s = 0; s < t->nslots; s++) {
        size_t size = t->slots[s] ? t->slots[s]->ids.size : 0;
        if (size != held_count[s]) {
            invariant("slot lookup holds ids found on no block");
            goto done;
        }
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyMem_Free(held_count);
    return res;
}

static PyObject *
Tree_get_num_blocks_total(Tree *t, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(t->blocks);
}

/* Runs a fully path-compressed tree would have: a block starts one unless it continues its
 * parent's only child with the same holders. */
static PyObject *
Tree_get_num_nodes(Tree *t, void *Py_UNUSED(closure))
{
    Py_ssize_t runs = 0;
    size_t sp = 0;
    for (Node *c = t->root.kid; c; c = c->next)
        if (push(&t->stack, &t->stack_cap, sp++, c) < 0)
            return NULL;
    while (sp) {
        Node *n = t->stack[--sp];
        Node *p = n->parent;
        if (p == &t->root || p->nkids != 1 || p->nheld != n->nheld)
            runs++;
        for (Node *c = n->kid; c; c = c->next)
            if (push(&t->stack, &t->stack_cap, sp++, c) < 0)
                return NULL;
    }
    return PyLong_FromSsize_t(runs);
}

/* ---- type plumbing -------------------------------------------------------------------- */

static PyObject *
Tree_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "RadixTree() takes no arguments");
        return NULL;
    }
    Tree *t = (Tree *)type->tp_alloc(type, 0);
    return (PyObject *)t; /* tp_alloc zeroes: an empty tree */
}

static void
Tree_dealloc(Tree *t)
{
    /* free every node: walk with the scratch stack (no Python calls, no errors expected) */
    size_t sp = 0;
    int ok = 1;
    for (Node *c = t->root.kid; c && ok; c = c->next)
        ok = push(&t->stack, &t->stack_cap, sp++, c) == 0;
    while (sp && ok) {
        Node *n = t->stack[--sp];
        for (Node *c = n->kid; c && ok; c = c->next)
            ok = push(&t->stack, &t->stack_cap, sp++, c) == 0;
        node_release(n);
    }
    if (!ok)
        PyErr_Clear(); /* leak the rest rather than crash */
    while (t->spare) {
        Node *n = t->spare;
        t->spare = n->next;
        node_release(n);
    }
    for (uint32_t s = 0; s < t->nslots; s++) {
        if (t->slots[s]) {
            PyMem_Free(t->slots[s]->ids.e);
            PyMem_Free(t->slots[s]);
        }
    }
    id_memo_clear(t->memo, 1 << MEMO_BITS);
    PyMem_Free(t->slots);
    PyMem_Free(t->mark);
    PyMem_Free(t->kids.e);
    PyMem_Free(t->stack);
    PyMem_Free(t->seen);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef Tree_methods[] = {
    {"store", (PyCFunction)(void (*)(void))Tree_store, METH_FASTCALL, NULL},
    {"store_hashes", (PyCFunction)(void (*)(void))Tree_store_hashes, METH_FASTCALL, NULL},
    {"apply_raw", (PyCFunction)(void (*)(void))Tree_apply_raw, METH_FASTCALL, NULL},
    {"remove", (PyCFunction)(void (*)(void))Tree_remove, METH_VARARGS | METH_KEYWORDS, NULL},
    {"clear", (PyCFunction)Tree_clear, METH_O, NULL},
    {"find_matches", (PyCFunction)Tree_find_matches, METH_O, NULL},
    {"num_blocks", (PyCFunction)Tree_num_blocks, METH_O, NULL},
    {"holds", (PyCFunction)(void (*)(void))Tree_holds, METH_FASTCALL, NULL},
    {"digest", (PyCFunction)Tree_digest, METH_O, NULL},
    {"slots", (PyCFunction)Tree_slots, METH_NOARGS, NULL},
    {"dump", (PyCFunction)Tree_dump, METH_O, NULL},
    {"check_invariants", (PyCFunction)Tree_check_invariants, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Tree_getset[] = {
    {"num_blocks_total", (getter)Tree_get_num_blocks_total, NULL, NULL, NULL},
    {"num_nodes", (getter)Tree_get_num_nodes, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TreeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dynamo.router._radix.RadixTree",
    .tp_basicsize = sizeof(Tree),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The prefix tree of KV blocks held by slots (contract: _radix.pyi).",
    .tp_new = Tree_new,
    .tp_dealloc = (destructor)Tree_dealloc,
    .tp_methods = Tree_methods,
    .tp_getset = Tree_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_radix",
    "The KV prefix tree as a native table (contract: _radix.pyi; fallback: _radix_fallback.py).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__radix(void)
{
    if (PyType_Ready(&TreeType) < 0)
        return NULL;
    str_block_hash = PyUnicode_InternFromString("block_hash");
    str_tokens_hash = PyUnicode_InternFromString("tokens_hash");
    if (str_block_hash == NULL || str_tokens_hash == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&TreeType);
    if (PyModule_AddObject(m, "RadixTree", (PyObject *)&TreeType) < 0) {
        Py_DECREF(&TreeType);
        Py_DECREF(m);
        return NULL;
    }
    static DynRadixApi api = {&TreeType, apply_raw};
    PyObject *capsule = PyCapsule_New(&api, DYN_RADIX_API_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/*
 * dynamo.router._blocks: BlockCounts, a refcounted multiset of 64-bit block hashes.
 *
 * Why native: ActiveSequences keeps one such multiset per (worker, dp_rank) and the load
 * projection asks each of them "how many of these query blocks are absent?" on every routing
 * decision (and on every POST /potential_loads of the slot tracker). With Python dicts each probe
 * chases pointers (index -> entry -> int object); in a live server, with the network stack
 * evicting caches between requests, that projection cost 3-4x its hot-loop figure and dominated
 * the request. Here keys and counts sit inline in one open-addressing array: a probe is one
 * cache line.
 *
 * Keys: Python ints in the signed or the unsigned 64-bit range, stored as their 64-bit pattern,
 * so -1 and 2**64 - 1 are the same block (the slot tracker receives signed values, the router
 * computes unsigned ones). items() returns the unsigned form.
 *
 * Table: linear probing, load factor at most 1/2, deletion by backward shift (no tombstones).
 * Slots are placed by a seeded mix of the key (a per-process random seed), so a client cannot
 * choose hashes that collide; a table of prefix keys only (below) places them by their own low
 * bits, which chain() has already mixed with its own seed.
 *
 * Prefix keys (the *_prefixes methods): the load accounting identifies an active block by its
 * position in the request, i.e. by the whole sequence of hashes up to it (a node of the trie of
 * the rank's active sequences, as the reference does). A node is named by a chained 64-bit key,
 * key[i] = chain(key[i-1], hash[i]), so a multiset of prefix keys counts trie nodes and a query's
 * absent prefix keys are its blocks outside the trie, with the same flat table. chain() mixes
 * with a second per-process seed: equal keys for different prefixes need a 64-bit collision,
 * which a client that never sees the seed cannot aim for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_id_memo.h"
#include "../_u64.h"

typedef struct {
    uint64_t key;
    uint64_t count; /* 0: the slot is empty */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t mask; /* capacity - 1; capacity is a power of two */
    Py_ssize_t used;
    /* 1: the keys are prefix keys (chain's output: already a seeded mix, which a client cannot
     * aim) and a key's slot is its own low bits; 0: any hash, placed by slot_of's seeded mix.
     * An empty table takes the mode of the first keys added (prefix_table / hash_table); a
     * prefix table given hashes is re-placed by the mix. */
    int own;
} BlockCounts;

#define MIN_CAPACITY 16

static uint64_t mix_seed;
static uint64_t chain_seed;

/* The prefix key of (the prefix named by parent) + hash; the empty prefix is 0. For a fixed
 * parent it is a bijection of hash, for a fixed hash a bijection of parent. */
static inline uint64_t
chain(uint64_t parent, uint64_t hash)
{
    uint64_t x = (parent * 0x9e3779b97f4a7c15ULL) ^ hash ^ chain_seed;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline size_t
slot_of(uint64_t key, size_t mask)
{
    /* splitmix64's finaliser over the seeded key: every key bit reaches the low bits. */
    uint64_t x = key ^ mix_seed;
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return (size_t)x & mask;
}

/* A key's home slot in t: the load accounting's tables hold prefix keys only, whose own bits
 * are as good as the mix (~200 probes a request: the walk, the add and the free). */
static inline size_t
home_of(const BlockCounts *t, uint64_t key)
{
    return t->own ? (size_t)key & t->mask : slot_of(key, t->mask);
}

/* The index of the slot holding key, or of the empty slot where it would go. */
static inline size_t
find(const BlockCounts *t, uint64_t key)
{
    size_t i = home_of(t, key);
    for (;;) {
        const Slot *s = &t->slots[i];
        if (s->count == 0 || s->key == key) {
            return i;
        }
        i = (i + 1) & t->mask;
    }
}

static int as_key_slow(PyObject *obj, uint64_t *out);

/* inline at its callers (a request's prefix keys convert its ~70 hashes) */
static inline int
as_key(PyObject *obj, uint64_t *out)
{
    if (dyn_u64_digits(obj, out)) /* the common case: a non-negative 64-bit int */
        return 0;
    return as_key_slow(obj, out);
}

static Py_NO_INLINE int
as_key_slow(PyObject *obj, uint64_t *out)
{
    int overflow;
    long long value;
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "block hashes must be int, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow == 0) {
        if (value == -1 && PyErr_Occurred()) {
            return -1;
        }
        *out = (uint64_t)value;
        return 0;
    }
    if (overflow > 0) {
        unsigned long long uvalue = DYN_AS_U64(obj);
        if (uvalue == (unsigned long long)-1 && PyErr_Occurred()) {
            goto out_of_range;
        }
        *out = (uint64_t)uvalue;
        return 0;
    }
out_of_range:
    PyErr_Clear();
    PyErr_SetString(PyExc_OverflowError,
                    "block hash outside the signed and unsigned 64-bit ranges");
    return -1;
}

static int
resize(BlockCounts *t, size_t capacity)
{
    Slot *old = t->slots;
    size_t old_capacity = old == NULL ? 0 : t->mask + 1;
    Slot *fresh = PyMem_Calloc(capacity, sizeof(Slot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->slots = fresh;
    t->mask = capacity - 1;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].count != 0) {
            fresh[find(t, old[i].key)] = old[i];
        }
    }
    PyMem_Free(old);
    return 0;
}

/* Before prefix keys are added: an empty table places keys by their own bits. */
static inline void
prefix_table(BlockCounts *t)
{
    if (t->used == 0) {
        t->own = 1;
    }
}

/* Before caller-given hashes are added: a table placing keys by their own bits is re-placed
 * by the seeded mix (0, or -1 with the table unchanged). */
static int
hash_table(BlockCounts *t)
{
    if (!t->own) {
        return 0;
    }
    t->own = 0;
    if (t->used != 0 && resize(t, t->mask + 1) < 0) {
        t->own = 1;
        return -1;
    }
    return 0;
}

/* Add n to key's count, inserting it when absent. */
static inline int
increment(BlockCounts *t, uint64_t key, uint64_t n)
{
    size_t i = find(t, key);
    if (t->slots[i].count != 0) {
        t->slots[i].count += n;
        return 0;
    }
    if ((size_t)(t->used + 1) * 2 > t->mask + 1) {
        if (resize(t, (t->mask + 1) * 2) < 0) {
            return -1;
        }
        i = find(t, key);
    }
    t->slots[i].key = key;
    t->slots[i].count = n;
    t->used++;
    return 0;
}

/* Empty slot i and shift later entries of its probe run back into the hole. */
static void
erase(BlockCounts *t, size_t i)
{
    size_t mask = t->mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (t->slots[j].count == 0) {
            break;
        }
        size_t home = home_of(t, t->slots[j].key);
        /* The hole lies on the entry's probe path from home to j: move the entry into it. */
        if (((i - home) & mask) < ((j - home) & mask)) {
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->slots[i].count = 0;
    t->slots[i].key = 0;
    t->used--;
}

static int
shrink_if_sparse(BlockCounts *t)
{
    size_t capacity = t->mask + 1;
    if (capacity > MIN_CAPACITY && (size_t)t->used * 8 < capacity) {
        size_t target = MIN_CAPACITY; /* the smallest that leaves the load at 1/4 or less */
        while (target < (size_t)t->used * 4) {
            target *= 2;
        }
        return resize(t, target);
    }
    return 0;
}

/* Apply fn to each int of an iterable (tuple and list without an iterator). */
typedef int (*KeyFn)(BlockCounts *, uint64_t);

static int
for_each_key(BlockCounts *t, PyObject *iterable, KeyFn fn)
{
    uint64_t key;
    if (PyTuple_CheckExact(iterable) || PyList_CheckExact(iterable)) {
        PyObject *seq = iterable;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t k = 0; k < n; k++) {
            /* A list may shrink under us only through Python code; none runs here. */
            if (as_key(PySequence_Fast_GET_ITEM(seq, k), &key) < 0 || fn(t, key) < 0) {
                return -1;
            }
        }
        return 0;
    }
    PyObject *it = PyObject_GetIter(iterable);
    if (it == NULL) {
        return -1;
    }
    PyObject *item;
    while ((item = PyIter_Next(it)) != NULL) {
        int rc = as_key(item, &key);
        Py_DECREF(item);
        if (rc < 0 || fn(t, key) < 0) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* Apply fn to the prefix key of each position of a sequence of ints. */
static int
for_each_prefix(BlockCounts *t, PyObject *iterable, KeyFn fn)
{
    uint64_t key, parent = 0;
    if (PyTuple_CheckExact(iterable) || PyList_CheckExact(iterable)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(iterable);
        for (Py_ssize_t k = 0; k < n; k++) {
            if (as_key(PySequence_Fast_GET_ITEM(iterable, k), &key) < 0) {
                return -1;
            }
            parent = chain(parent, key);
            if (fn(t, parent) < 0) {
                return -1;
            }
        }
        return 0;
    }
    PyObject *it = PyObject_GetIter(iterable);
    if (it == NULL) {
        return -1;
    }
    PyObject *item;
    while ((item = PyIter_Next(it)) != NULL) {
        int rc = as_key(item, &key);
        Py_DECREF(item);
        if (rc == 0) {
            parent = chain(parent, key);
            rc = fn(t, parent);
        }
        if (rc < 0) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

static inline int
add_one(BlockCounts *t, uint64_t key)
{
    return increment(t, key, 1);
}

static inline int
remove_one(BlockCounts *t, uint64_t key)
{
    size_t i = find(t, key);
    if (t->slots[i].count == 0) {
        PyObject *missing = PyLong_FromUnsignedLongLong(key);
        if (missing != NULL) {
            PyErr_SetObject(PyExc_KeyError, missing);
            Py_DECREF(missing);
        }
        return -1;
    }
    if (--t->slots[i].count == 0) {
        erase(t, i);
    }
    return 0;
}

/* ------------------------------------------------------------------ the Python type */

static PyTypeObject BlockCountsType;

static PyObject *
BlockCounts_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    BlockCounts *self = (BlockCounts *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->slots = NULL;
    self->used = 0;
    if (resize(self, MIN_CAPACITY) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
BlockCounts_init(BlockCounts *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"hashes", NULL};
    PyObject *hashes = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:BlockCounts", kwlist, &hashes)) {
        return -1;
    }
    if (hashes == NULL) {
        return 0;
    }
    if (hash_table(self) < 0) {
        return -1;
    }
    if ((PyTuple_CheckExact(hashes) || PyList_CheckExact(hashes)) && self->used == 0) {
        /* Size the table once for the sequence instead of growing it step by step. */
        size_t capacity = MIN_CAPACITY;
        while (capacity < (size_t)PySequence_Fast_GET_SIZE(hashes) * 2) {
            capacity *= 2;
        }
        if (capacity > self->mask + 1 && resize(self, capacity) < 0) {
            return -1;
        }
    }
    return for_each_key(self, hashes, add_one);
}

static void
BlockCounts_dealloc(BlockCounts *self)
{
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
BlockCounts_len(BlockCounts *self)
{
    return self->used;
}

static int
BlockCounts_contains(BlockCounts *self, PyObject *obj)
{
    uint64_t key;
    if (as_key(obj, &key) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError) ||
            PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            return 0; /* not a 64-bit int: never held */
        }
        return -1;
    }
    return self->slots[find(self, key)].count != 0;
}

static PyObject *
BlockCounts_add(BlockCounts *self, PyObject *hashes)
{
    if (hash_table(self) < 0 || for_each_key(self, hashes, add_one) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
BlockCounts_remove(BlockCounts *self, PyObject *hashes)
{
    int rc = for_each_key(self, hashes, remove_one);
    if (shrink_if_sparse(self) < 0 || rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
BlockCounts_add_prefixes(BlockCounts *self, PyObject *hashes)
{
    prefix_table(self);
    if (for_each_prefix(self, hashes, add_one) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
BlockCounts_remove_prefixes(BlockCounts *self, PyObject *hashes)
{
    int rc = for_each_prefix(self, hashes, remove_one);
    if (shrink_if_sparse(self) < 0 || rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
BlockCounts_of_prefixes(PyTypeObject *type, PyObject *hashes)
{
    BlockCounts *self = (BlockCounts *)PyObject_CallNoArgs((PyObject *)type);
    if (self == NULL) {
        return NULL;
    }
    prefix_table(self);
    if ((PyTuple_CheckExact(hashes) || PyList_CheckExact(hashes))) {
        size_t capacity = MIN_CAPACITY;
        while (capacity < (size_t)PySequence_Fast_GET_SIZE(hashes) * 2) {
            capacity *= 2;
        }
        if (capacity > self->mask + 1 && resize(self, capacity) < 0) {
            Py_DECREF(self);
            return NULL;
        }
    }
    if (for_each_prefix(self, hashes, add_one) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *
prefix_keys(PyObject *module, PyObject *hashes)
{
    PyObject *seq = PySequence_Fast(hashes, "prefix_keys() takes an iterable of int");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    uint64_t key, parent = 0;
    if (out == NULL) {
        goto fail;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (as_key(PySequence_Fast_GET_ITEM(seq, k), &key) < 0) {
            goto fail;
        }
        parent = chain(parent, key);
        PyObject *value = PyLong_FromUnsignedLongLong(parent);
        if (value == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, k, value);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* The prefix keys held in a bytes object made by prefix_key_bytes (native-endian uint64 each):
 * their address and count, or -1 (TypeError / ValueError) for anything else. */
static int
key_buffer(PyObject *keys, const char *what, const char **data, Py_ssize_t *n)
{
    if (!PyBytes_Check(keys)) {
        PyErr_Format(PyExc_TypeError, "%s takes the bytes of prefix_key_bytes(), not %.100s",
                     what, Py_TYPE(keys)->tp_name);
        return -1;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(keys);
    if (size % (Py_ssize_t)sizeof(uint64_t) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes are not whole 64-bit keys", what, size);
        return -1;
    }
    *data = PyBytes_AS_STRING(keys);
    *n = size / (Py_ssize_t)sizeof(uint64_t);
    return 0;
}

static inline uint64_t
key_at(const char *data, Py_ssize_t k)
{
    uint64_t key;
    memcpy(&key, data + (size_t)k * sizeof(uint64_t), sizeof key);
    return key;
}

/* Apply fn to each key of a prefix_key_bytes buffer (inlined with its fn: a request's keys are
 * added and removed a key at a time, ~70 each). */
static inline Py_ALWAYS_INLINE int
for_each_buffered(BlockCounts *t, PyObject *keys, const char *what, KeyFn fn)
{
    const char *data;
    Py_ssize_t n;
    if (key_buffer(keys, what, &data, &n) < 0) {
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (fn(t, key_at(data, k)) < 0) {
            return -1;
        }
    }
    return 0;
}

static PyObject *
BlockCounts_add_prefix_keys(BlockCounts *self, PyObject *keys)
{
    prefix_table(self);
    if (self->used == 0 && PyBytes_Check(keys)) {
        /* Size an empty table once for the request (as the constructor does): with 100 workers
         * most ranks run one request at a time, so each add found the table shrunk back to
         * its minimum by the last free and grew it four times (16 -> 256 slots for 72 keys),
         * ~2 resizes and ~7k instructions a request. */
        size_t n = (size_t)PyBytes_GET_SIZE(keys) / sizeof(uint64_t);
        size_t capacity = MIN_CAPACITY;
        while (capacity < n * 2) {
            capacity *= 2;
        }
        if (capacity > self->mask + 1 && resize(self, capacity) < 0) {
            return NULL;
        }
    }
    if (for_each_buffered(self, keys, "add_prefix_keys()", add_one) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
BlockCounts_remove_prefix_keys(BlockCounts *self, PyObject *keys)
{
    int rc = for_each_buffered(self, keys, "remove_prefix_keys()", remove_one);
    if (shrink_if_sparse(self) < 0 || rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The last prefix_key_bytes calls' keys, by their leading hash objects (``dynamo/_id_memo.h``:
 * the offline replay's prompts of a prefix group share ~64 of their ~72 hash objects); a key here
 * is the position's chained prefix key. */
#define MEMO_BITS 5

static IdMemo key_memo[1 << MEMO_BITS];

static void
memo_clear(void *Py_UNUSED(module))
{
    id_memo_clear(key_memo, 1 << MEMO_BITS);
}

/* prefix_key_bytes(hashes): the prefix key of each position, packed (native-endian uint64):
 * what a request's load accounting keeps, computed once (the route's walk, the record, the
 * free read it instead of chaining the hashes again). */
static PyObject *
prefix_key_bytes(PyObject *module, PyObject *hashes)
{
    PyObject *seq = PySequence_Fast(hashes, "prefix_key_bytes() takes an iterable of int");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    char *data = PyBytes_AS_STRING(out);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    IdMemo *m = NULL;
    Py_ssize_t same = 0; /* leading hashes that are the memo's objects */
    if (n > 0) {
        m = id_memo_way(key_memo, MEMO_BITS, items[0]);
        same = id_memo_same(m, items, n);
        if (same > 0)
            memcpy(data, m->keys, (size_t)same * sizeof(uint64_t));
    }
    uint64_t key, parent = same ? m->keys[same - 1] : 0;
    for (Py_ssize_t k = same; k < n; k++) {
        if (as_key(items[k], &key) < 0) {
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        parent = chain(parent, key);
        memcpy(data + (size_t)k * sizeof(uint64_t), &parent, sizeof parent);
    }
    if (m != NULL) { /* this call becomes the memo (a prefix group's next prompt shares it) */
        id_memo_keep(m, items, (const uint64_t *)data, NULL, same, n);
    }
    Py_DECREF(seq);
    return out;
}

/* Whether t holds the k-th key packed at data. */
static inline int
holds_at(const BlockCounts *t, const char *data, Py_ssize_t k)
{
    return t->slots[find(t, key_at(data, k))].count != 0;
}

/* Per table (each checked to be a BlockCounts), n minus the depth of the longest leading run of
 * keys (packed at data) held there: see new_blocks. A table holds whole paths, so the keys it
 * holds are a leading run: the first absent one is found by bisection (~8 probes for a group's
 * 64-block prefix where the walk made 65), after the two ends (a table without the request's
 * first block: one probe, as the walk). */
static PyObject *
walk_tables(PyObject *tables, const char *data, Py_ssize_t n)
{
    Py_ssize_t m = PySequence_Fast_GET_SIZE(tables);
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *t = PySequence_Fast_GET_ITEM(tables, j);
        if (!PyObject_TypeCheck(t, &BlockCountsType)) {
            PyErr_Format(PyExc_TypeError, "new_blocks() takes BlockCounts, not %.100s",
                         Py_TYPE(t)->tp_name);
            return NULL;
        }
    }
    PyObject *out = PyList_New(m);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        const BlockCounts *t = (const BlockCounts *)PySequence_Fast_GET_ITEM(tables, j);
        Py_ssize_t depth = 0;
        if (t->used != 0 && n > 0 && holds_at(t, data, 0)) {
            if (holds_at(t, data, n - 1)) {
                depth = n;
            } else { /* key lo held, key hi not: bisect to the first one not held */
                Py_ssize_t lo = 0, hi = n - 1;
                while (hi - lo > 1) {
                    Py_ssize_t mid = lo + (hi - lo) / 2;
                    if (holds_at(t, data, mid)) {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
                depth = hi;
            }
        }
        PyObject *value = PyLong_FromSsize_t(n - depth);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, value);
    }
    return out;
}

/* new_blocks(tables, hashes): for each table, the blocks of a request (its block hashes, in
 * order) outside the trie the table holds: len(hashes) - the depth of the longest prefix of the
 * request that is a node there. The tables hold whole trie paths (add_prefixes of requests),
 * so the nodes of the request's path present in a table are exactly a leading run of it: its
 * end is bisected, one probe for a table that holds none of the request (count_absent over
 * of_prefixes probes every block of every table). */
static PyObject *
new_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "new_blocks(tables, hashes)");
        return NULL;
    }
    PyObject *tables = PySequence_Fast(args[0], "new_blocks() takes a sequence of BlockCounts");
    if (tables == NULL) {
        return NULL;
    }
    PyObject *hashes = PySequence_Fast(args[1], "new_blocks() takes an iterable of int");
    if (hashes == NULL) {
        Py_DECREF(tables);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    uint64_t stack_keys[128];
    uint64_t *keys = n <= 128 ? stack_keys : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    PyObject *out = NULL;
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t key, parent = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (as_key(PySequence_Fast_GET_ITEM(hashes, k), &key) < 0) {
            goto done;
        }
        keys[k] = parent = chain(parent, key);
    }
    out = walk_tables(tables, (const char *)keys, n);
done:
    if (keys != stack_keys) {
        PyMem_Free(keys);
    }
    Py_DECREF(hashes);
    Py_DECREF(tables);
    return out;
}

/* new_blocks_of_keys(tables, keys): new_blocks of the request whose prefix_key_bytes are keys. */
static PyObject *
new_blocks_of_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "new_blocks_of_keys(tables, keys)");
        return NULL;
    }
    const char *data;
    Py_ssize_t n;
    if (key_buffer(args[1], "new_blocks_of_keys()", &data, &n) < 0) {
        return NULL;
    }
    PyObject *tables = PySequence_Fast(args[0], "new_blocks() takes a sequence of BlockCounts");
    if (tables == NULL) {
        return NULL;
    }
    PyObject *out = walk_tables(tables, data, n);
    Py_DECREF(tables);
    return out;
}

/* ---------------------------------------------------------- from a JSON array of ints */

static inline const char *
skip_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) {
        p++;
    }
    return p;
}

static PyObject *
json_error(Py_ssize_t index, const char *what)
{
    if (index < 0) {
        PyErr_Format(PyExc_ValueError, "%s", what);
    } else {
        PyErr_Format(PyExc_ValueError, "%s - at `[%zd]`", what, index);
    }
    return NULL;
}

/* The value of 8 ASCII digits at p, or -1 if they are not all digits (simdjson's SWAR trick:
 * little-endian loads, 3 multiplies instead of 8 dependent ones). */
static inline int64_t
eight_digits(const char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    if (((v & 0xF0F0F0F0F0F0F0F0ULL) |
         (((v + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL) >> 4)) != 0x3333333333333333ULL) {
        return -1;
    }
    v -= 0x3030303030303030ULL;
    v = (v * 10) + (v >> 8);
    v = (((v & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32))) +
         (((v >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32)))) >>
        32;
    return (int64_t)v;
}

/* Parse one JSON integer in the signed 64-bit range at *pp (past it on success). */
static int
parse_int(const char **pp, const char *end, uint64_t *out, const char **why)
{
    const char *p = *pp;
    int negative = 0;
    uint64_t magnitude = 0;
    if (p < end && *p == '-') {
        negative = 1;
        p++;
    }
    if (p >= end || *p < '0' || *p > '9') {
        *why = "Expected `int`";
        return -1;
    }
    if (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9') {
        *why = "Expected `int`, got a number with a leading zero";
        return -1;
    }
    /* 18 digits cannot overflow: no checks for them (block hashes have 18-20). */
    const char *fast_end = end - p > 18 ? p + 18 : end;
    for (int64_t eight; fast_end - p >= 8 && (eight = eight_digits(p)) >= 0; p += 8) {
        magnitude = magnitude * 100000000 + (uint64_t)eight;
    }
    for (; p < fast_end && (unsigned)(*p - '0') <= 9; p++) {
        magnitude = magnitude * 10 + (uint64_t)(*p - '0');
    }
    for (; p < end && *p >= '0' && *p <= '9'; p++) {
        if (__builtin_mul_overflow(magnitude, 10, &magnitude) ||
            __builtin_add_overflow(magnitude, (uint64_t)(*p - '0'), &magnitude)) {
            *why = "Expected `int` in the signed 64-bit range";
            return -1;
        }
    }
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) {
        *why = "Expected `int`, got `float`";
        return -1;
    }
    if (magnitude > (negative ? (uint64_t)1 << 63 : ((uint64_t)1 << 63) - 1)) {
        *why = "Expected `int` in the signed 64-bit range";
        return -1;
    }
    *out = negative ? (uint64_t)0 - magnitude : magnitude;
    *pp = p;
    return 0;
}

static PyObject *
parse_json(PyTypeObject *type, PyObject *data, int prefixes)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const char *p = view.buf;
    const char *end = p + view.len;
    BlockCounts *self = NULL;
    PyObject *result = NULL;
    Py_ssize_t index = 0;
    const char *why = NULL;
    uint64_t parent = 0;

    p = skip_ws(p, end);
    if (p >= end || *p != '[') {
        json_error(-1, "Expected `array` of `int`");
        goto done;
    }
    /* Commas + 1 bounds the element count: size the table once. */
    Py_ssize_t bound = 1;
    for (const char *q = p; (q = memchr(q, ',', (size_t)(end - q))) != NULL; q++) {
        bound++;
    }
    size_t capacity = MIN_CAPACITY;
    while (capacity < (size_t)bound * 2) {
        capacity *= 2;
    }
    self = (BlockCounts *)type->tp_alloc(type, 0);
    if (self == NULL) {
        goto done;
    }
    self->own = prefixes;
    if (resize(self, capacity) < 0) { /* the empty table, sized once */
        goto done;
    }
    p = skip_ws(p + 1, end);
    if (p < end && *p == ']') {
        p++;
    } else {
        for (;;) {
            uint64_t key;
            if (parse_int(&p, end, &key, &why) < 0) {
                json_error(index, why);
                goto done;
            }
            if (prefixes) {
                parent = chain(parent, key);
                key = parent;
            }
            if (add_one(self, key) < 0) {
                goto done;
            }
            index++;
            p = skip_ws(p, end);
            if (p < end && *p == ',') {
                p = skip_ws(p + 1, end);
                continue;
            }
            if (p < end && *p == ']') {
                p++;
                break;
            }
            json_error(index, "Expected `,` or `]` after an array element");
            goto done;
        }
    }
    if (skip_ws(p, end) != end) {
        json_error(-1, "Trailing characters after the array");
        goto done;
    }
    result = (PyObject *)self;
    self = NULL;
done:
    Py_XDECREF(self);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *
BlockCounts_from_json(PyTypeObject *type, PyObject *data)
{
    return parse_json(type, data, 0);
}

static PyObject *
BlockCounts_prefixes_from_json(PyTypeObject *type, PyObject *data)
{
    return parse_json(type, data, 1);
}

static PyObject *
BlockCounts_count(BlockCounts *self, PyObject *obj)
{
    uint64_t key;
    if (as_key(obj, &key) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(self->slots[find(self, key)].count);
}

/* Query keys probed per batch: their slots are prefetched together, so the cache misses of a
 * batch overlap instead of following one another (the tables are too big for L1/L2 once the
 * network stack has run between two requests). */
#define PROBE_BATCH 64

static PyObject *
BlockCounts_count_absent(BlockCounts *self, PyObject *other)
{
    if (!PyObject_TypeCheck(other, &BlockCountsType)) {
        PyErr_Format(PyExc_TypeError, "count_absent() takes BlockCounts, not %.100s",
                     Py_TYPE(other)->tp_name);
        return NULL;
    }
    const BlockCounts *query = (const BlockCounts *)other;
    if (self->used == 0) {
        return PyLong_FromSsize_t(query->used);
    }
    uint64_t keys[PROBE_BATCH];
    size_t homes[PROBE_BATCH];
    Py_ssize_t absent = 0;
    size_t capacity = query->mask + 1;
    size_t i = 0;
    while (i < capacity) {
        int n = 0;
        for (; i < capacity && n < PROBE_BATCH; i++) {
            const Slot *s = &query->slots[i];
            if (s->count != 0) {
                keys[n] = s->key;
                homes[n] = home_of(self, s->key);
                __builtin_prefetch(&self->slots[homes[n]]);
                n++;
            }
        }
        for (int k = 0; k < n; k++) {
            size_t j = homes[k];
            for (;;) {
                const Slot *s = &self->slots[j];
                if (s->count == 0) {
                    absent++;
                    break;
                }
                if (s->key == keys[k]) {
                    break;
                }
                j = (j + 1) & self->mask;
            }
        }
    }
    return PyLong_FromSsize_t(absent);
}

static PyObject *
BlockCounts_items(BlockCounts *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(self->used);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t k = 0;
    for (size_t i = 0; i <= self->mask; i++) {
        const Slot *s = &self->slots[i];
        if (s->count == 0) {
            continue;
        }
        PyObject *pair = Py_BuildValue("(KK)", (unsigned long long)s->key,
                                       (unsigned long long)s->count);
        if (pair == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k++, pair);
    }
    return out;
}

static PyObject *
BlockCounts_clear(BlockCounts *self, PyObject *Py_UNUSED(ignored))
{
    Slot *fresh = PyMem_Calloc(MIN_CAPACITY, sizeof(Slot));
    if (fresh == NULL) {
        return PyErr_NoMemory();
    }
    PyMem_Free(self->slots);
    self->slots = fresh;
    self->mask = MIN_CAPACITY - 1;
    self->used = 0;
    Py_RETURN_NONE;
}

static PyObject *
BlockCounts_sizeof(BlockCounts *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(sizeof(BlockCounts) + (self->mask + 1) * sizeof(Slot));
}

static PyObject *
BlockCounts_repr(BlockCounts *self)
{
    return PyUnicode_FromFormat("BlockCounts(<%zd blocks>)", self->used);
}

static PyMethodDef BlockCounts_methods[] = {
    {"from_json", (PyCFunction)BlockCounts_from_json, METH_O | METH_CLASS,
     "from_json(data): the hashes of a JSON array of integers in the signed 64-bit range "
     "(bytes-like, e.g. a msgspec.Raw). ValueError, naming the element, on anything else."},
    {"add", (PyCFunction)BlockCounts_add, METH_O,
     "add(hashes): count one more holder of each hash (a repeated hash counts twice)."},
    {"remove", (PyCFunction)BlockCounts_remove, METH_O,
     "remove(hashes): count one holder less of each hash; a hash whose count reaches 0 "
     "leaves. KeyError on a hash that is not held (those before it stay removed)."},
    {"prefixes_from_json", (PyCFunction)BlockCounts_prefixes_from_json, METH_O | METH_CLASS,
     "prefixes_from_json(data): the prefix keys of a JSON array of integers in the signed "
     "64-bit range; errors as from_json."},
    {"of_prefixes", (PyCFunction)BlockCounts_of_prefixes, METH_O | METH_CLASS,
     "of_prefixes(hashes): a table holding the prefix key of each position of hashes."},
    {"add_prefixes", (PyCFunction)BlockCounts_add_prefixes, METH_O,
     "add_prefixes(hashes): add the prefix key of each position of hashes."},
    {"remove_prefixes", (PyCFunction)BlockCounts_remove_prefixes, METH_O,
     "remove_prefixes(hashes): remove the prefix key of each position of hashes; KeyError on "
     "one that is not held (those before it stay removed)."},
    {"add_prefix_keys", (PyCFunction)BlockCounts_add_prefix_keys, METH_O,
     "add_prefix_keys(keys): add_prefixes of the hashes whose prefix_key_bytes are keys."},
    {"remove_prefix_keys", (PyCFunction)BlockCounts_remove_prefix_keys, METH_O,
     "remove_prefix_keys(keys): remove_prefixes of the hashes whose prefix_key_bytes are "
     "keys; KeyError on one that is not held (those before it stay removed)."},
    {"count", (PyCFunction)BlockCounts_count, METH_O, "count(hash): its count, 0 if absent."},
    {"count_absent", (PyCFunction)BlockCounts_count_absent, METH_O,
     "count_absent(query): how many distinct hashes of query (a BlockCounts) are absent here."},
    {"items", (PyCFunction)BlockCounts_items, METH_NOARGS,
     "items(): [(hash as unsigned 64-bit int, count)] in no particular order."},
    {"clear", (PyCFunction)BlockCounts_clear, METH_NOARGS, "clear(): drop every hash."},
    {"__sizeof__", (PyCFunction)BlockCounts_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods BlockCounts_as_sequence = {
    .sq_length = (lenfunc)BlockCounts_len,
    .sq_contains = (objobjproc)BlockCounts_contains,
};

static PyTypeObject BlockCountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dynamo.router._blocks.BlockCounts",
    .tp_doc = PyDoc_STR(
        "BlockCounts(hashes=()): a multiset of 64-bit block hashes with a count per hash.\n\n"
        "A hash is an int in the signed or unsigned 64-bit range; both forms of one bit\n"
        "pattern are the same hash. len() is the number of distinct hashes."),
    .tp_basicsize = sizeof(BlockCounts),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = BlockCounts_new,
    .tp_init = (initproc)BlockCounts_init,
    .tp_dealloc = (destructor)BlockCounts_dealloc,
    .tp_repr = (reprfunc)BlockCounts_repr,
    .tp_as_sequence = &BlockCounts_as_sequence,
    .tp_methods = BlockCounts_methods,
};

static PyMethodDef module_methods[] = {
    {"prefix_keys", (PyCFunction)prefix_keys, METH_O,
     "prefix_keys(hashes): [the unsigned prefix key of each position of hashes]."},
    {"new_blocks", (PyCFunction)(void (*)(void))new_blocks, METH_FASTCALL,
     "new_blocks(tables, hashes): per table (holding whole trie paths), the blocks of hashes "
     "past the longest prefix of them that is a node there."},
    {"prefix_key_bytes", (PyCFunction)prefix_key_bytes, METH_O,
     "prefix_key_bytes(hashes): the prefix key of each position of hashes, packed as "
     "native-endian unsigned 64-bit integers in one bytes object."},
    {"new_blocks_of_keys", (PyCFunction)(void (*)(void))new_blocks_of_keys, METH_FASTCALL,
     "new_blocks_of_keys(tables, keys): new_blocks of the hashes whose prefix_key_bytes are "
     "keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef blocks_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dynamo.router._blocks",
    .m_doc = "Native block-hash multiset for the router's load accounting.",
    .m_size = -1,
    .m_methods = module_methods,
    .m_free = memo_clear,
};

static int
init_seed(void)
{
    PyObject *os = PyImport_ImportModule("os");
    if (os == NULL) {
        return -1;
    }
    PyObject *raw = PyObject_CallMethod(os, "urandom", "i", (int)(2 * sizeof(uint64_t)));
    Py_DECREF(os);
    if (raw == NULL) {
        return -1;
    }
    memcpy(&mix_seed, PyBytes_AS_STRING(raw), sizeof(mix_seed));
    memcpy(&chain_seed, PyBytes_AS_STRING(raw) + sizeof(mix_seed), sizeof(chain_seed));
    Py_DECREF(raw);
    return 0;
}

PyMODINIT_FUNC
PyInit__blocks(void)
{
    if (init_seed() < 0 || PyType_Ready(&BlockCountsType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&blocks_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&BlockCountsType);
    if (PyModule_AddObject(module, "BlockCounts", (PyObject *)&BlockCountsType) < 0) {
        Py_DECREF(&BlockCountsType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

/*
 * dynamo.engine_core._kv: the KV block manager of one DP rank (FACTS §6.3) as a native table:
 * refcounted active blocks, the LRU inactive pool, prefix lookup by sequence hash, the physical
 * slot each block occupies, and the KV events (Stored / Removed) those changes produce.
 *
 * Why native: every admission probes its prompt's blocks (cached prefix, slots needed) and
 * references them, every filled block is promoted, every finished or preempted request releases
 * each of its blocks, and allocations evict inactive blocks. With the state in Python containers
 * (a dict of refcounts, an OrderedDict as the LRU, dicts of slots and local hashes, a set of
 * private blocks, a free list) those were ~15 % of the offline replay's CPU even with the loops
 * in C (docs/performance.md, "Offline replay"); the live mocker and the PyTorch engine run the
 * same manager.
 *
 * Layout: everything is indexed by slot. A slot is free (on the free stack, popped from the
 * end), private (a sequence's unique block: its id is its slot) or holds a cached full block
 * (entry: sequence hash, local hash, refcount; refcount 0 = inactive, linked into the LRU
 * list). One open-addressing table maps a sequence hash to its slot. Hashes are 64-bit ints in
 * [-2**63, 2**64) and come back as given.
 *
 * Events are KVCacheEvent structs, or (``record_raw_events``: the offline replay, whose index
 * is in-process) one buffer of words a drain (dynamo/protocol/kv_raw.py), written as the
 * blocks change: no object per event or block.
 *
 * ``_C_API_4`` (a capsule, ``_kv_api.h``): the admission's calls (``num_cached_prefix``,
 * ``num_slots_needed``, ``use``) on keys converted once, ``promote_run`` / ``release`` on item
 * arrays, the flags, ``allocate_unique`` and the drains without a method call, for
 * ``_pass.c``.
 *
 * The contract is ``_kv.pyi``; ``_kv_fallback.py`` is the same in Python (``dynamo.native``
 * picks one) and tests/unit/engine_core/test_kv_native.py holds the two to the same events and
 * state on random operation sequences.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "../_id_memo.h"
#include "../_u64.h"
#include "_kv_api.h"

typedef struct {
    uint64_t hash, local;
    int32_t prev, next; /* LRU links (slots), -1: none */
    int32_t refcount;   /* > 0 active, 0 inactive */
    uint8_t neg, lneg;  /* given as negative ints */
    uint8_t silent;     /* cached, never announced (received from a prefill worker) */
    uint8_t kind;       /* FREE, UNIQUE or FULL */
} Entry;

enum { FREE = 0, UNIQUE = 1, FULL = 2 };

typedef struct {
    uint64_t key;
    int32_t slot;  /* -1: empty */
    uint32_t home; /* the key's first bucket (in the padding): a deletion's shift reads it */
} MapEntry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_blocks;
    PyObject *dp_rank;
    char enable_prefix_caching;
    Entry *e;
    int32_t *free_slots;
    Py_ssize_t nfree;
    MapEntry *map;
    size_t mask;
    int32_t lru_head, lru_tail;
    Py_ssize_t n_full_active, n_inactive, n_unique;
    PyObject *events;
    long long next_event_id;
    /* the raw form (dynamo/protocol/kv_raw.py) when recorded: words, a negative flag per
     * word, the events in it and the first one's id */
    char raw;
    uint64_t raw_dp_rank;
    uint64_t *rw;
    uint8_t *rneg;
    size_t rlen, rcap;
    long long rcount, rfirst;
    /* the private blocks' id objects, one a slot, made at its first allocation and shared
     * (ids are slots: allocating and freeing an int a private block was ~150 instructions) */
    PyObject **ids;
} KV;

static PyObject *cls_stored, *cls_removed, *cls_block, *cls_event;
static PyObject *kw_stored, *kw_removed, *kw_event;

static int
load_event_classes(void)
{
    if (cls_event != NULL)
        return 0;
    PyObject *m = PyImport_ImportModule("dynamo.protocol.kv_events");
    if (m == NULL)
        return -1;
    cls_stored = PyObject_GetAttrString(m, "BlocksStored");
    cls_removed = PyObject_GetAttrString(m, "BlocksRemoved");
    cls_block = PyObject_GetAttrString(m, "StoredBlock");
    PyObject *event = PyObject_GetAttrString(m, "KVCacheEvent");
    Py_DECREF(m);
    kw_stored = Py_BuildValue("(ss)", "parent_hash", "blocks");
    kw_removed = Py_BuildValue("(s)", "block_hashes");
    kw_event = Py_BuildValue("(sss)", "event_id", "data", "dp_rank");
    if (!cls_stored || !cls_removed || !cls_block || !event || !kw_stored || !kw_removed ||
        !kw_event) {
        Py_XDECREF(event);
        return -1;
    }
    cls_event = event; /* last: marks the set loaded */
    return 0;
}

/* ---- keys and the hash -> slot table -------------------------------------------------- */

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

/* to_key's general path (any int) */
static int
to_key_slow(PyObject *obj, uint64_t *key, uint8_t *neg)
{
    if (!PyLong_Check(obj))
        return 0;
    /* sequence hashes: half of them >= 2**63, read from their digits (dynamo/_u64.h) */
    if (dyn_u64_digits(obj, key)) {
        *neg = 0;
        return 1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred())
            return -1;
        *key = (uint64_t)v;
        *neg = v < 0;
        return 1;
    }
    if (overflow < 0)
        return 0;
    unsigned long long u = DYN_AS_U64(obj);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    *key = (uint64_t)u;
    *neg = 0;
    return 1;
}

/* 1: converted; 0: not a 64-bit int (no error set); -1: error. Inline for the common exact
 * int of at most 64 bits (every hash an admission, promotion and release converts). */
static inline int
to_key(PyObject *obj, uint64_t *key, uint8_t *neg)
{
    if (dyn_u64_digits(obj, key)) {
        *neg = 0;
        return 1;
    }
    return to_key_slow(obj, key, neg);
}

/* A key the manager must store: TypeError / OverflowError otherwise. */
static int
need_key(PyObject *obj, uint64_t *key, uint8_t *neg)
{
    int rc = to_key(obj, key, neg);
    if (rc == 0) {
        if (PyLong_Check(obj))
            PyErr_SetString(PyExc_OverflowError, "block hashes must fit 64 bits");
        else
            PyErr_Format(PyExc_TypeError, "block hashes must be ints, not %.100s",
                         Py_TYPE(obj)->tp_name);
        return -1;
    }
    return rc;
}

static PyObject *
key_obj(uint64_t key, uint8_t neg)
{
    return neg ? PyLong_FromLongLong((long long)key) : PyLong_FromUnsignedLongLong(key);
}

static inline int32_t
map_get(const KV *kv, uint64_t key)
{
    size_t i = (size_t)mix64(key) & kv->mask;
    for (;;) {
        const MapEntry *m = &kv->map[i];
        if (m->slot < 0)
            return -1;
        if (m->key == key)
            return m->slot;
        i = (i + 1) & kv->mask;
    }
}

/* key must be absent; the table never fills (capacity >= 2 * num_blocks) */
static inline void
map_put(KV *kv, uint64_t key, int32_t slot)
{
    size_t home = (size_t)mix64(key) & kv->mask, i = home;
    while (kv->map[i].slot >= 0)
        i = (i + 1) & kv->mask;
    kv->map[i] = (MapEntry){key, slot, (uint32_t)home};
}

static void
map_del(KV *kv, uint64_t key)
{
    size_t mask = kv->mask, i = (size_t)mix64(key) & mask;
    for (;;) {
        if (kv->map[i].slot < 0)
            return;
        if (kv->map[i].key == key)
            break;
        i = (i + 1) & mask;
    }
    size_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (kv->map[j].slot < 0)
            break;
        size_t home = kv->map[j].home;
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            kv->map[hole] = kv->map[j];
            hole = j;
        }
    }
    kv->map[hole].slot = -1;
}

/* the slot of a cached full block, or -1 (also for anything that is not a 64-bit int) */
static int32_t
find(const KV *kv, PyObject *obj)
{
    uint64_t key;
    uint8_t neg;
    int rc = to_key(obj, &key, &neg);
    if (rc <= 0) {
        if (rc < 0)
            PyErr_Clear();
        return -1;
    }
    return map_get(kv, key);
}

/* ---- the LRU (inactive blocks; head: least recently used) ----------------------------- */

static inline void
lru_append(KV *kv, int32_t s)
{
    Entry *e = &kv->e[s];
    e->prev = kv->lru_tail;
    e->next = -1;
    if (kv->lru_tail >= 0)
        kv->e[kv->lru_tail].next = s;
    else
        kv->lru_head = s;
    kv->lru_tail = s;
    kv->n_inactive++;
}

static inline void
lru_remove(KV *kv, int32_t s)
{
    Entry *e = &kv->e[s];
    if (e->prev >= 0)
        kv->e[e->prev].next = e->next;
    else
        kv->lru_head = e->next;
    if (e->next >= 0)
        kv->e[e->next].prev = e->prev;
    else
        kv->lru_tail = e->prev;
    e->prev = e->next = -1;
    kv->n_inactive--;
}

/* ---- events --------------------------------------------------------------------------- */

static int
emit(KV *kv, PyObject *data)
{
    PyObject *eid = PyLong_FromLongLong(kv->next_event_id);
    if (eid == NULL)
        return -1;
    PyObject *args[3] = {eid, data, kv->dp_rank};
    PyObject *ev = PyObject_Vectorcall(cls_event, args, 0, kw_event);
    Py_DECREF(eid);
    if (ev == NULL)
        return -1;
    int rc = PyList_Append(kv->events, ev);
    Py_DECREF(ev);
    if (rc == 0)
        kv->next_event_id++;
    return rc;
}

static int
emit_stored(KV *kv, PyObject *parent, PyObject *blocks)
{
    PyObject *args[2] = {parent, blocks};
    PyObject *data = PyObject_Vectorcall(cls_stored, args, 0, kw_stored);
    if (data == NULL)
        return -1;
    int rc = emit(kv, data);
    Py_DECREF(data);
    return rc;
}

static PyObject *
stored_block(PyObject *hash, PyObject *local)
{
    PyObject *args[2] = {hash, local};
    return PyObject_Vectorcall(cls_block, args, 2, NULL);
}

/* ---- the raw form (dynamo/protocol/kv_raw.py: the layout) ------------------------------ */

enum { RAW_STORED = 1, RAW_REMOVED = 2, RAW_HAS_PARENT = 4, RAW_NEG = 8, RAW_HEADER = 3 };

static int raw_grow(KV *kv, size_t extra);

/* Room for ``extra`` more words: 0, or -1 with MemoryError. */
static inline int
raw_reserve(KV *kv, size_t extra)
{
    return kv->rlen + extra <= kv->rcap ? 0 : raw_grow(kv, extra);
}

static int
raw_grow(KV *kv, size_t extra)
{
    size_t cap = kv->rcap ? kv->rcap : 64;
    while (cap < kv->rlen + extra)
        cap *= 2;
    uint64_t *w = PyMem_Realloc(kv->rw, cap * sizeof(uint64_t));
    if (w == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    kv->rw = w;
    uint8_t *g = PyMem_Realloc(kv->rneg, cap);
    if (g == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    kv->rneg = g;
    kv->rcap = cap;
    return 0;
}

static inline int
raw_word(KV *kv, uint64_t v, uint8_t neg)
{
    if (raw_reserve(kv, 1) < 0)
        return -1;
    kv->rw[kv->rlen] = v;
    kv->rneg[kv->rlen++] = neg;
    return 0;
}

/* Start an event: its head word's place (filled by raw_end), or -1. */
static Py_ssize_t
raw_begin(KV *kv)
{
    if (kv->rlen == 0 && (raw_word(kv, kv->raw_dp_rank, 0) < 0 || raw_word(kv, 0, 0) < 0 ||
                          raw_word(kv, 0, 0) < 0))
        return -1;
    Py_ssize_t head = (Py_ssize_t)kv->rlen;
    return raw_word(kv, 0, 0) < 0 ? -1 : head;
}

/* Close the event begun at ``head``: its flags and, if a value was negative, the flag words. */
static int
raw_end(KV *kv, Py_ssize_t head, uint64_t kind, Py_ssize_t n)
{
    size_t start = (size_t)head + 1, end = kv->rlen, any = 0;
    for (size_t i = start; i < end; i++)
        any |= kv->rneg[i];
    if (any) {
        if (raw_reserve(kv, end - start) < 0)
            return -1;
        for (size_t i = start; i < end; i++) {
            kv->rw[kv->rlen] = kv->rneg[i];
            kv->rneg[kv->rlen++] = 0;
        }
        kind |= RAW_NEG;
    }
    kv->rw[head] = kind | ((uint64_t)n << 8);
    if (kv->rcount++ == 0)
        kv->rfirst = kv->next_event_id;
    kv->next_event_id++;
    return 0;
}

/* One Stored event under construction: its blocks as StoredBlock objects, or in the raw form. */
typedef struct {
    PyObject *list;   /* objects: the blocks so far */
    PyObject *parent; /* objects: borrowed (the caller's arguments hold it) */
    Py_ssize_t head;  /* raw: the head word's place */
    Py_ssize_t n;
    int open;
} Run;

/* Add the block (hash, local), whose keys are hk/hneg and lk/lneg, to the run, opening it
 * under ``parent`` if it is not open. */
static int
run_add(KV *kv, Run *r, PyObject *parent, PyObject *hash, PyObject *local, uint64_t hk,
        uint8_t hneg, uint64_t lk, uint8_t lneg)
{
    if (!kv->raw) {
        if (!r->open) {
            if ((r->list = PyList_New(0)) == NULL)
                return -1;
            r->parent = parent;
            r->open = 1;
        }
        PyObject *blk = stored_block(hash, local);
        int rc = blk == NULL ? -1 : PyList_Append(r->list, blk);
        Py_XDECREF(blk);
        return rc;
    }
    if (!r->open) {
        uint64_t k;
        uint8_t ng;
        r->n = 0;
        r->parent = parent;
        if ((r->head = raw_begin(kv)) < 0 ||
            (parent != Py_None && (need_key(parent, &k, &ng) < 0 || raw_word(kv, k, ng) < 0)))
            return -1;
        r->open = 1;
    }
    if (raw_reserve(kv, 2) < 0)
        return -1;
    kv->rw[kv->rlen] = hk;
    kv->rneg[kv->rlen++] = hneg;
    kv->rw[kv->rlen] = lk;
    kv->rneg[kv->rlen++] = lneg;
    r->n++;
    return 0;
}

/* Emit the open run's Stored event (nothing if none is open). */
static int
run_close(KV *kv, Run *r)
{
    if (!r->open)
        return 0;
    r->open = 0;
    if (kv->raw)
        return raw_end(kv, r->head, RAW_STORED | (r->parent != Py_None ? RAW_HAS_PARENT : 0),
                       r->n);
    int rc = emit_stored(kv, r->parent, r->list);
    Py_CLEAR(r->list);
    return rc;
}

/* Evict LRU inactive blocks until n slots are free (one Removed event for the announced). */
static int
make_room(KV *kv, Py_ssize_t n)
{
    Py_ssize_t free = kv->num_blocks - kv->n_full_active - kv->n_unique - kv->n_inactive;
    if (free >= n)
        return 0;
    /* the evicted hashes' objects, for a Removed event (the raw form writes words instead) */
    PyObject *evicted = kv->raw ? NULL : PyList_New(0);
    if (evicted == NULL && !kv->raw)
        return -1;
    Py_ssize_t head = -1, nraw = 0;
    for (Py_ssize_t k = 0; k < n - free; k++) {
        int32_t s = kv->lru_head;
        if (s < 0) {
            Py_XDECREF(evicted);
            PyErr_SetString(PyExc_KeyError, "dictionary is empty");
            return -1;
        }
        Entry *e = &kv->e[s];
        lru_remove(kv, s);
        map_del(kv, e->hash);
        e->kind = FREE;
        kv->free_slots[kv->nfree++] = s;
        if (e->silent)
            continue;
        if (kv->raw) {
            if ((head < 0 && (head = raw_begin(kv)) < 0) || raw_word(kv, e->hash, e->neg) < 0)
                return -1;
            nraw++;
            continue;
        }
        PyObject *h = key_obj(e->hash, e->neg);
        if (h == NULL || PyList_Append(evicted, h) < 0) {
            Py_XDECREF(h);
            Py_DECREF(evicted);
            return -1;
        }
        Py_DECREF(h);
    }
    int rc = 0;
    if (head >= 0)
        rc = raw_end(kv, head, RAW_REMOVED, nraw);
    if (evicted != NULL && PyList_GET_SIZE(evicted) > 0) {
        PyObject *args[1] = {evicted};
        PyObject *data = PyObject_Vectorcall(cls_removed, args, 0, kw_removed);
        rc = data == NULL ? -1 : emit(kv, data);
        Py_XDECREF(data);
    }
    Py_XDECREF(evicted);
    return rc;
}

/* ---- queries -------------------------------------------------------------------------- */

static Py_ssize_t
num_active(const KV *kv)
{
    return kv->n_full_active + kv->n_unique;
}

static PyObject *
KV_num_active_blocks(KV *kv, void *Py_UNUSED(c))
{
    return PyLong_FromSsize_t(num_active(kv));
}

static PyObject *
KV_num_inactive_blocks(KV *kv, void *Py_UNUSED(c))
{
    return PyLong_FromSsize_t(kv->n_inactive);
}

static PyObject *
KV_num_available_blocks(KV *kv, void *Py_UNUSED(c))
{
    return PyLong_FromSsize_t(kv->num_blocks - num_active(kv));
}

static PyObject *
KV_slot_of(KV *kv, PyObject *h)
{
    int32_t s = find(kv, h);
    if (s < 0) {
        PyErr_SetObject(PyExc_KeyError, h);
        return NULL;
    }
    return PyLong_FromLong(s);
}

static PyObject *
KV_local_hash_of(KV *kv, PyObject *h)
{
    int32_t s = find(kv, h);
    if (s < 0) {
        PyErr_SetObject(PyExc_KeyError, h);
        return NULL;
    }
    return key_obj(kv->e[s].local, kv->e[s].lneg);
}

static PyObject *
KV_block_table(KV *kv, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "block_table(full_blocks, unique_blocks)");
        return NULL;
    }
    PyObject *full = PySequence_Fast(args[0], "full_blocks must be a sequence");
    if (full == NULL)
        return NULL;
    PyObject *out = PySequence_List(args[1]);
    if (out == NULL) {
        Py_DECREF(full);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(full);
    PyObject *table = PyList_New(n);
    if (table == NULL)
        goto fail;
    PyObject *const *items = PySequence_Fast_ITEMS(full);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot = KV_slot_of(kv, items[i]);
        if (slot == NULL) {
            Py_DECREF(table);
            goto fail;
        }
        PyList_SET_ITEM(table, i, slot);
    }
    /* full blocks lead, then the private ones */
    if (PyList_SetSlice(out, 0, 0, table) < 0) {
        Py_DECREF(table);
        goto fail;
    }
    Py_DECREF(table);
    Py_DECREF(full);
    return out;
fail:
    Py_DECREF(full);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
KV_refcount(KV *kv, PyObject *h)
{
    int32_t s = find(kv, h);
    return PyLong_FromLong(s < 0 ? 0 : kv->e[s].refcount);
}

static PyObject *
KV_is_cached(KV *kv, PyObject *h)
{
    return PyBool_FromLong(find(kv, h) >= 0);
}

static PyObject *
KV_cached_blocks(KV *kv, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PySet_New(NULL);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t s = 0; s < kv->num_blocks; s++) {
        const Entry *e = &kv->e[s];
        if (e->kind != FULL)
            continue;
        PyObject *h = key_obj(e->hash, e->neg);
        if (h == NULL || PySet_Add(out, h) < 0) {
            Py_XDECREF(h);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(h);
    }
    return out;
}

static PyObject *
KV_num_cached_prefix(KV *kv, PyObject *hashes)
{
    PyObject *seq = PySequence_Fast(hashes, "block_hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = 0;
    if (kv->enable_prefix_caching) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
        PyObject *const *items = PySequence_Fast_ITEMS(seq);
        while (n < len && find(kv, items[n]) >= 0)
            n++;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(n);
}

static Py_ssize_t
count_missing(const KV *kv, PyObject *seq)
{
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq), missing = 0;
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < len; i++) {
        int32_t s = find(kv, items[i]);
        if (s < 0 || kv->e[s].refcount == 0)
            missing++;
    }
    return missing;
}

static PyObject *
KV_num_slots_needed(KV *kv, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "num_slots_needed(block_hashes, num_unique)");
        return NULL;
    }
    Py_ssize_t extra = PyLong_AsSsize_t(args[1]);
    if (extra == -1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "block_hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t missing = count_missing(kv, seq);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(missing + extra);
}

/* ---- mutations ------------------------------------------------------------------------ */

static inline void
store_full(KV *kv, int32_t s, uint64_t h, uint8_t neg, uint64_t lk, uint8_t lneg, int silent)
{
    Entry *e = &kv->e[s];
    *e = (Entry){h, lk, -1, -1, 1, neg, lneg, (uint8_t)silent, FULL};
    map_put(kv, h, s);
    kv->n_full_active++;
}

/* keys[i]'s slot (-1: not stored), looked up once for an admission's calls: ``slots[i]`` is
 * DYN_KV_SLOT_UNKNOWN until then (_kv_api.h). */
static inline int32_t
slot_at(const KV *kv, const uint64_t *keys, int32_t *slots, Py_ssize_t i)
{
    if (slots[i] == DYN_KV_SLOT_UNKNOWN)
        slots[i] = map_get(kv, keys[i]);
    return slots[i];
}

static int use_keys(PyObject *self, PyObject *const *items, PyObject *const *litems,
                    uint64_t *keys, uint8_t *negs, const uint8_t *ok, int32_t *slots,
                    Py_ssize_t n, int announce);

static PyObject *
KV_use(KV *kv, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"block_hashes", "local_hashes", "announce", NULL};
    PyObject *hashes, *locals_obj;
    int announce = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|$p:use", kwlist, &hashes, &locals_obj,
                                     &announce))
        return NULL;
    if (!kv->enable_prefix_caching) {
        PyErr_SetString(PyExc_RuntimeError,
                        "full blocks are not used when prefix caching is off");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(hashes, "block_hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *lseq = PySequence_Fast(locals_obj, "local_hashes must be a sequence");
    if (lseq == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *keys = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    uint8_t *negs = PyMem_Malloc((size_t)(n ? n : 1));
    if (keys == NULL || negs == NULL)
        PyErr_NoMemory();
    else if (PySequence_Fast_GET_SIZE(lseq) < n)
        PyErr_SetString(PyExc_IndexError, "local_hashes is shorter than block_hashes");
    else if (use_keys((PyObject *)kv, PySequence_Fast_ITEMS(seq), PySequence_Fast_ITEMS(lseq),
                      keys, negs, NULL, NULL, n, announce) == 0)
        res = Py_NewRef(Py_None);
    PyMem_Free(keys);
    PyMem_Free(negs);
    Py_DECREF(seq);
    Py_DECREF(lseq);
    return res;
}

/* ``use`` of the chain ``items`` (local hashes ``litems``, at least n) whose keys are in
 * keys/negs where ok[i] (ok NULL: none converted yet; converted here, in order): 0, or -1
 * with the error ``use`` raises. The capsule's ``use`` (_kv_api.h). */
static int
use_keys(PyObject *self, PyObject *const *items, PyObject *const *litems, uint64_t *keys,
         uint8_t *negs, const uint8_t *ok, int32_t *slots, Py_ssize_t n, int announce)
{
    KV *kv = (KV *)self;
    if (!kv->enable_prefix_caching) {
        PyErr_SetString(PyExc_RuntimeError,
                        "full blocks are not used when prefix caching is off");
        return -1;
    }
    int rc = -1;
    Run run = {0};
    int32_t *own = NULL; /* the slots' array when the caller has none */
    Py_ssize_t *absent = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (absent == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (slots == NULL) {
        if ((own = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t))) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            own[i] = DYN_KV_SLOT_UNKNOWN;
        slots = own;
    }
    Py_ssize_t missing = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ok == NULL || !ok[i]) {
            if (need_key(items[i], &keys[i], &negs[i]) < 0)
                goto done;
            slots[i] = DYN_KV_SLOT_UNKNOWN;
        }
        int32_t s = slot_at(kv, keys, slots, i);
        if (s < 0 || kv->e[s].refcount == 0)
            missing++;
        uint64_t lk;
        uint8_t lneg;
        if (s < 0 && need_key(litems[i], &lk, &lneg) < 0) /* checked before any change */
            goto done;
    }
    if (missing > kv->num_blocks - num_active(kv)) {
        PyErr_SetString(PyExc_RuntimeError, "not enough KV blocks");
        goto done;
    }
    /* pin every block we already have first, so eviction below never takes one of ours (the
     * slots looked up above: nothing changed the table since) */
    Py_ssize_t nabsent = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t s = slots[i];
        if (s < 0) {
            absent[nabsent++] = i;
            continue;
        }
        Entry *e = &kv->e[s];
        if (e->refcount == 0) {
            lru_remove(kv, s);
            kv->n_full_active++;
        }
        e->refcount++;
    }
    if (make_room(kv, nabsent) < 0)
        goto done;
    for (Py_ssize_t k = 0; k < nabsent; k++) {
        Py_ssize_t i = absent[k];
        int32_t s = map_get(kv, keys[i]);
        if (s >= 0) { /* a hash repeated in the chain: already stored above */
            kv->e[s].refcount++;
        }
        uint64_t lk = 0;
        uint8_t lneg = 0;
        if ((s < 0 || (announce && kv->raw)) && need_key(litems[i], &lk, &lneg) < 0)
            goto done; /* checked above: cannot fail */
        if (s < 0) {
            s = kv->free_slots[--kv->nfree];
            store_full(kv, s, keys[i], negs[i], lk, lneg, !announce);
        }
        slots[i] = s;
        if (!announce)
            continue;
        /* a run's parent: the block before its first */
        if (run_add(kv, &run, i > 0 ? items[i - 1] : Py_None, items[i], litems[i], keys[i],
                    negs[i], lk, lneg) < 0 ||
            ((k + 1 == nabsent || absent[k + 1] != i + 1) && run_close(kv, &run) < 0))
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(run.list);
    PyMem_Free(absent);
    PyMem_Free(own);
    return rc;
}

static PyObject *allocate_n(PyObject *self, Py_ssize_t n);

static PyObject *
KV_allocate_unique(KV *kv, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0");
        return NULL;
    }
    return allocate_n((PyObject *)kv, n);
}

/* allocate_unique(n), n >= 0: the method's result (the capsule's ``allocate_unique``). */
static PyObject *
allocate_n(PyObject *self, Py_ssize_t n)
{
    KV *kv = (KV *)self;
    if (n > kv->num_blocks - num_active(kv))
        Py_RETURN_NONE;
    if (make_room(kv, n) < 0)
        return NULL;
    PyObject *ids = PyList_New(n);
    if (ids == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        int32_t slot = kv->free_slots[kv->nfree - 1 - k];
        PyObject *x = kv->ids[slot];
        if (x == NULL && (x = kv->ids[slot] = PyLong_FromLong(slot)) == NULL) {
            Py_DECREF(ids);
            return NULL;
        }
        PyList_SET_ITEM(ids, k, Py_NewRef(x));
    }
    for (Py_ssize_t k = 0; k < n; k++)
        kv->e[kv->free_slots[--kv->nfree]].kind = UNIQUE;
    kv->n_unique += n;
    return ids;
}

/* a private block's id as a number, -1 if it is not an int that fits a long (no error set):
 * ids are slots, so an exact int of at most one digit is read from it, any other through the
 * API (the same value) */
static inline long
id_value(PyObject *obj)
{
#if PY_VERSION_HEX < 0x030C0000
    if (PyLong_CheckExact(obj) && (Py_SIZE(obj) == 0 || Py_SIZE(obj) == 1))
        return Py_SIZE(obj) == 0 ? 0 : (long)((PyLongObject *)obj)->ob_digit[0];
#endif
    long v = PyLong_Check(obj) ? PyLong_AsLong(obj) : -1;
    if (v == -1 && PyErr_Occurred())
        PyErr_Clear();
    return v;
}

/* a private block's id as a slot, or -1 with KeyError set */
static inline int32_t
unique_slot(KV *kv, PyObject *obj)
{
    long v = id_value(obj);
    if (v < 0 || v >= kv->num_blocks || kv->e[v].kind != UNIQUE) {
        PyErr_SetString(PyExc_KeyError, "a private block that is not allocated");
        return -1;
    }
    return (int32_t)v;
}

/* promote_run on item arrays (the method's lists, or a C caller's, _kv_api.h): each key
 * converted once. 0, or -1 with the method's error (nothing changes on a bad id or hash). */
static int
promote_items(PyObject *self, PyObject *const *uids, PyObject *const *hs, PyObject *const *ls,
              Py_ssize_t n, PyObject *parent, int32_t *slots_out)
{
    KV *kv = (KV *)self;
    enum { ON_STACK = 32 };
    uint64_t hk_s[ON_STACK], lk_s[ON_STACK];
    int32_t us_s[ON_STACK];
    uint8_t hn_s[ON_STACK], ln_s[ON_STACK];
    uint64_t *hk = hk_s, *lk = lk_s;
    int32_t *us = us_s;
    uint8_t *hn = hn_s, *ln = ln_s;
    void *heap = NULL;
    int rc = -1;
    Run run = {0};
    if (n > ON_STACK) {
        size_t m = (size_t)n;
        heap = PyMem_Malloc(m * (2 * sizeof(uint64_t) + sizeof(int32_t) + 2));
        if (heap == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        hk = heap, lk = hk + m, us = (int32_t *)(lk + m), hn = (uint8_t *)(us + m), ln = hn + m;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* check first: nothing changes on a bad id */
        if ((us[i] = unique_slot(kv, uids[i])) < 0 || need_key(hs[i], &hk[i], &hn[i]) < 0 ||
            need_key(ls[i], &lk[i], &ln[i]) < 0)
            goto done;
    }
    PyObject *run_parent = parent;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t u = us[i];
        if (kv->e[u].kind != UNIQUE) { /* the same id twice */
            PyErr_SetString(PyExc_KeyError, "a private block that is not allocated");
            goto done;
        }
        kv->e[u].kind = FREE;
        kv->n_unique--;
        int32_t s = map_get(kv, hk[i]);
        if (s >= 0) { /* already cached: the private copy collapses onto it */
            Entry *e = &kv->e[s];
            if (e->refcount == 0) {
                lru_remove(kv, s);
                kv->n_full_active++;
            }
            e->refcount++;
            kv->free_slots[kv->nfree++] = u;
            if (slots_out != NULL)
                slots_out[i] = s;
            if (run_close(kv, &run) < 0)
                goto done;
            run_parent = hs[i];
            continue;
        }
        store_full(kv, u, hk[i], hn[i], lk[i], ln[i], 0);
        if (slots_out != NULL)
            slots_out[i] = u;
        if (run_add(kv, &run, run_parent, hs[i], ls[i], hk[i], hn[i], lk[i], ln[i]) < 0)
            goto done;
    }
    rc = run_close(kv, &run);
done:
    Py_XDECREF(run.list);
    PyMem_Free(heap);
    return rc;
}

static PyObject *
KV_promote_run(KV *kv, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "promote_run(unique_ids, block_hashes, local_hashes, parent)");
        return NULL;
    }
    PyObject *useq = NULL, *hseq = NULL, *lseq = NULL, *res = NULL;
    useq = PySequence_Fast(args[0], "unique_ids must be a sequence");
    hseq = useq ? PySequence_Fast(args[1], "block_hashes must be a sequence") : NULL;
    lseq = hseq ? PySequence_Fast(args[2], "local_hashes must be a sequence") : NULL;
    if (lseq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(useq);
    if (PySequence_Fast_GET_SIZE(hseq) != n || PySequence_Fast_GET_SIZE(lseq) != n) {
        PyErr_SetString(PyExc_ValueError, "promote_run: the three lists differ in length");
        goto done;
    }
    if (promote_items((PyObject *)kv, PySequence_Fast_ITEMS(useq), PySequence_Fast_ITEMS(hseq),
                      PySequence_Fast_ITEMS(lseq), n, args[3], NULL) == 0)
        res = Py_NewRef(Py_None);
done:
    Py_XDECREF(useq);
    Py_XDECREF(hseq);
    Py_XDECREF(lseq);
    return res;
}

static PyObject *
KV_promote(KV *kv, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "promote(unique_id, block_hash, local_hash, parent)");
        return NULL;
    }
    PyObject *u = PyList_New(1), *h = PyList_New(1), *l = PyList_New(1);
    PyObject *res = NULL;
    if (u && h && l) {
        Py_INCREF(args[0]);
        PyList_SET_ITEM(u, 0, args[0]);
        Py_INCREF(args[1]);
        PyList_SET_ITEM(h, 0, args[1]);
        Py_INCREF(args[2]);
        PyList_SET_ITEM(l, 0, args[2]);
        PyObject *a[4] = {u, h, l, args[3]};
        res = KV_promote_run(kv, a, 4);
    }
    Py_XDECREF(u);
    Py_XDECREF(h);
    Py_XDECREF(l);
    return res;
}

/* The slot of the full block ``h`` given its kept slot ``s`` (a hint, _kv_api.h): ``s`` when
 * it holds a full block of h's key, else h looked up (-1: not cached, or not a 64-bit int). */
static inline int32_t
find_at(const KV *kv, PyObject *h, int32_t s)
{
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    /* the common hash, an exact int of three digits (>= 2**60), compared digit by digit with
     * the entry's key (the same test as its conversion's, without assembling it) */
    if ((size_t)s < (size_t)kv->num_blocks && Py_IS_TYPE(h, &PyLong_Type) && Py_SIZE(h) == 3) {
        const digit *d = ((PyLongObject *)h)->ob_digit;
        const Entry *e = &kv->e[s];
        uint64_t x =
            ((uint64_t)d[2] << (2 * PyLong_SHIFT)) | ((uint64_t)d[1] << PyLong_SHIFT) | d[0];
        if (x == e->hash && d[2] < (1U << (64 - 2 * PyLong_SHIFT)) && e->kind == FULL)
            return s;
    }
#endif
    uint64_t key;
    uint8_t neg;
    int rc = to_key(h, &key, &neg);
    if (rc <= 0) {
        if (rc < 0)
            PyErr_Clear(); /* as find(): not found */
        return -1;
    }
    if (s >= 0 && s < kv->num_blocks && kv->e[s].kind == FULL && kv->e[s].hash == key)
        return s; /* the one slot the table maps the key to */
    return map_get(kv, key);
}

/* Drop a reference to the full block at slot ``s`` (-1: ``h`` is not cached): 0, or -1 with
 * KeyError(h) when it is not held. */
static inline int
unref(KV *kv, int32_t s, PyObject *h)
{
    if (s < 0 || kv->e[s].refcount == 0) {
        PyErr_SetObject(PyExc_KeyError, h);
        return -1;
    }
    if (--kv->e[s].refcount == 0) {
        kv->n_full_active--;
        lru_append(kv, s);
    }
    return 0;
}

/* release on item arrays (the method's lists, or a C caller's, _kv_api.h; ``slots``: the
 * hashes' kept slots, or NULL): 0, or -1 with the method's error. */
static int
release_items(PyObject *self, PyObject *const *hs, const int32_t *slots, Py_ssize_t nh,
              PyObject *const *uids, Py_ssize_t nu)
{
    KV *kv = (KV *)self;
    for (Py_ssize_t i = 0; i < nu; i++) {
        if (unique_slot(kv, uids[i]) < 0) {
            PyErr_SetString(PyExc_KeyError, "releasing a private block that is not allocated");
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < nu; i++) {
        int32_t u = (int32_t)id_value(uids[i]); /* checked above (a repeated id: FREE now) */
        if (kv->e[u].kind == UNIQUE) {
            kv->e[u].kind = FREE;
            kv->n_unique--;
            kv->free_slots[kv->nfree++] = u;
        }
    }
    /* tail first: within a chain the leaves become the least recently used */
    if (slots != NULL) {
        for (Py_ssize_t i = nh - 1; i >= 0; i--)
            if (unref(kv, find_at(kv, hs[i], slots[i]), hs[i]) < 0)
                return -1;
    } else {
        for (Py_ssize_t i = nh - 1; i >= 0; i--)
            if (unref(kv, find(kv, hs[i]), hs[i]) < 0)
                return -1;
    }
    return 0;
}

static PyObject *
KV_release(KV *kv, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "release(block_hashes, unique_ids)");
        return NULL;
    }
    PyObject *useq = PySequence_Fast(args[1], "unique_ids must be a sequence");
    if (useq == NULL)
        return NULL;
    PyObject *hseq = PySequence_Fast(args[0], "block_hashes must be a sequence");
    if (hseq == NULL) {
        Py_DECREF(useq);
        return NULL;
    }
    int rc = release_items((PyObject *)kv, PySequence_Fast_ITEMS(hseq), NULL,
                           PySequence_Fast_GET_SIZE(hseq), PySequence_Fast_ITEMS(useq),
                           PySequence_Fast_GET_SIZE(useq));
    Py_DECREF(useq);
    Py_DECREF(hseq);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *
KV_drain_events(KV *kv, PyObject *Py_UNUSED(ignored))
{
    if (kv->raw) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this KV manager records raw events: drain_raw_events");
        return NULL;
    }
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL)
        return NULL;
    PyObject *events = kv->events;
    kv->events = fresh;
    return events;
}

static PyObject *
KV_drain_raw_events(KV *kv, PyObject *Py_UNUSED(ignored))
{
    if (!kv->raw) {
        PyErr_SetString(PyExc_RuntimeError, "this KV manager does not record raw events");
        return NULL;
    }
    if (kv->rcount == 0) {
        kv->rlen = 0;
        return PyBytes_FromStringAndSize(NULL, 0);
    }
    kv->rw[1] = (uint64_t)kv->rfirst;
    kv->rw[2] = (uint64_t)kv->rcount;
    PyObject *out = PyBytes_FromStringAndSize((const char *)kv->rw,
                                              (Py_ssize_t)(kv->rlen * sizeof(uint64_t)));
    if (out != NULL)
        kv->rlen = 0, kv->rcount = 0;
    return out;
}

static PyObject *
KV_record_raw_events(KV *kv, PyObject *Py_UNUSED(ignored))
{
    if (PyList_GET_SIZE(kv->events) > 0) {
        PyErr_SetString(PyExc_RuntimeError, "drain the pending events first");
        return NULL;
    }
    uint64_t rank;
    uint8_t neg;
    int rc = to_key(kv->dp_rank, &rank, &neg);
    if (rc < 0)
        return NULL;
    if (rc == 0 || neg) {
        PyErr_SetString(PyExc_ValueError, "raw events need a dp_rank in [0, 2**64)");
        return NULL;
    }
    kv->raw_dp_rank = rank;
    kv->raw = 1;
    Py_RETURN_NONE;
}

static PyObject *
KV_raw_events(KV *kv, void *Py_UNUSED(c))
{
    return PyBool_FromLong(kv->raw);
}

static PyObject *
broken(const char *msg)
{
    PyErr_SetString(PyExc_AssertionError, msg);
    return NULL;
}

static PyObject *
KV_check_invariants(KV *kv, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t full_active = 0, inactive = 0, unique = 0, full = 0;
    for (Py_ssize_t s = 0; s < kv->num_blocks; s++) {
        const Entry *e = &kv->e[s];
        if (e->kind == UNIQUE)
            unique++;
        if (e->kind != FULL)
            continue;
        full++;
        if (e->refcount < 0)
            return broken("negative refcount");
        if (e->refcount > 0)
            full_active++;
        else
            inactive++;
        if (map_get(kv, e->hash) != (int32_t)s)
            return broken("slotless block");
        if (e->silent && !kv->enable_prefix_caching)
            return broken("silent block with caching off");
    }
    if (full_active != kv->n_full_active || inactive != kv->n_inactive || unique != kv->n_unique)
        return broken("block counts disagree with the table");
    Py_ssize_t lru = 0;
    for (int32_t s = kv->lru_head, prev = -1; s >= 0; prev = s, s = kv->e[s].next) {
        if (kv->e[s].kind != FULL || kv->e[s].refcount != 0 || kv->e[s].prev != prev)
            return broken("inactive pool holds an active or free block");
        if (++lru > kv->num_blocks)
            return broken("inactive pool is cyclic");
    }
    if (lru != inactive)
        return broken("inactive pool misses a block");
    Py_ssize_t mapped = 0;
    for (size_t i = 0; i <= kv->mask; i++)
        mapped += kv->map[i].slot >= 0;
    if (mapped != full)
        return broken("hash table holds a block that is not cached");
    if (full + unique + kv->nfree != kv->num_blocks)
        return broken("leaked slots");
    char *seen = PyMem_Calloc((size_t)kv->num_blocks, 1);
    if (seen == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < kv->nfree; k++) {
        int32_t s = kv->free_slots[k];
        if (s < 0 || s >= kv->num_blocks || seen[s] || kv->e[s].kind != FREE) {
            PyMem_Free(seen);
            return broken("slot used twice");
        }
        seen[s] = 1;
    }
    PyMem_Free(seen);
    if (!kv->enable_prefix_caching && full)
        return broken("full blocks with caching off");
    Py_RETURN_NONE;
}

/* ---- type plumbing -------------------------------------------------------------------- */

static PyObject *
KV_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"num_blocks", "dp_rank", "enable_prefix_caching", NULL};
    Py_ssize_t num_blocks;
    PyObject *dp_rank = NULL;
    int caching = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|$Op:KVManager", kwlist, &num_blocks,
                                     &dp_rank, &caching))
        return NULL;
    if (num_blocks <= 0) {
        PyErr_SetString(PyExc_ValueError, "num_blocks must be positive");
        return NULL;
    }
    if (num_blocks > INT32_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "num_blocks is too large");
        return NULL;
    }
    if (load_event_classes() < 0)
        return NULL;
    KV *kv = (KV *)type->tp_alloc(type, 0);
    if (kv == NULL)
        return NULL;
    kv->num_blocks = num_blocks;
    kv->enable_prefix_caching = (char)caching;
    kv->dp_rank = dp_rank ? dp_rank : PyLong_FromLong(0);
    if (dp_rank)
        Py_INCREF(dp_rank);
    size_t cap = 16;
    while (cap < (size_t)num_blocks * 2)
        cap *= 2;
    kv->e = PyMem_Calloc((size_t)num_blocks, sizeof(Entry));
    kv->free_slots = PyMem_Malloc((size_t)num_blocks * sizeof(int32_t));
    kv->map = PyMem_Malloc(cap * sizeof(MapEntry));
    kv->ids = PyMem_Calloc((size_t)num_blocks, sizeof(PyObject *));
    kv->events = PyList_New(0);
    if (kv->dp_rank == NULL || kv->e == NULL || kv->free_slots == NULL || kv->map == NULL ||
        kv->ids == NULL || kv->events == NULL) {
        Py_DECREF(kv);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    kv->mask = cap - 1;
    for (size_t i = 0; i < cap; i++)
        kv->map[i].slot = -1;
    /* popped from the end: lowest slots first, so a fresh pool fills in order */
    for (Py_ssize_t k = 0; k < num_blocks; k++)
        kv->free_slots[k] = (int32_t)(num_blocks - 1 - k);
    kv->nfree = num_blocks;
    kv->lru_head = kv->lru_tail = -1;
    return (PyObject *)kv;
}

static void
KV_dealloc(KV *kv)
{
    if (kv->ids != NULL)
        for (Py_ssize_t s = 0; s < kv->num_blocks; s++)
            Py_XDECREF(kv->ids[s]);
    PyMem_Free(kv->ids);
    PyMem_Free(kv->e);
    PyMem_Free(kv->free_slots);
    PyMem_Free(kv->map);
    PyMem_Free(kv->rw);
    PyMem_Free(kv->rneg);
    Py_XDECREF(kv->events);
    Py_XDECREF(kv->dp_rank);
    Py_TYPE(kv)->tp_free((PyObject *)kv);
}

static PyMethodDef KV_methods[] = {
    {"slot_of", (PyCFunction)KV_slot_of, METH_O, NULL},
    {"local_hash_of", (PyCFunction)KV_local_hash_of, METH_O, NULL},
    {"block_table", (PyCFunction)(void (*)(void))KV_block_table, METH_FASTCALL, NULL},
    {"refcount", (PyCFunction)KV_refcount, METH_O, NULL},
    {"is_cached", (PyCFunction)KV_is_cached, METH_O, NULL},
    {"cached_blocks", (PyCFunction)KV_cached_blocks, METH_NOARGS, NULL},
    {"num_cached_prefix", (PyCFunction)KV_num_cached_prefix, METH_O, NULL},
    {"num_slots_needed", (PyCFunction)(void (*)(void))KV_num_slots_needed, METH_FASTCALL, NULL},
    {"use", (PyCFunction)(void (*)(void))KV_use, METH_VARARGS | METH_KEYWORDS, NULL},
    {"allocate_unique", (PyCFunction)KV_allocate_unique, METH_O, NULL},
    {"promote", (PyCFunction)(void (*)(void))KV_promote, METH_FASTCALL, NULL},
    {"promote_run", (PyCFunction)(void (*)(void))KV_promote_run, METH_FASTCALL, NULL},
    {"release", (PyCFunction)(void (*)(void))KV_release, METH_FASTCALL, NULL},
    {"drain_events", (PyCFunction)KV_drain_events, METH_NOARGS, NULL},
    {"drain_raw_events", (PyCFunction)KV_drain_raw_events, METH_NOARGS, NULL},
    {"record_raw_events", (PyCFunction)KV_record_raw_events, METH_NOARGS, NULL},
    {"check_invariants", (PyCFunction)KV_check_invariants, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KV_getset[] = {
    {"num_active_blocks", (getter)KV_num_active_blocks, NULL, NULL, NULL},
    {"num_inactive_blocks", (getter)KV_num_inactive_blocks, NULL, NULL, NULL},
    {"num_available_blocks", (getter)KV_num_available_blocks, NULL, NULL, NULL},
    {"raw_events", (getter)KV_raw_events, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef KV_members[] = {
    {"num_blocks", T_PYSSIZET, offsetof(KV, num_blocks), READONLY, NULL},
    {"dp_rank", T_OBJECT_EX, offsetof(KV, dp_rank), READONLY, NULL},
    {"enable_prefix_caching", T_BOOL, offsetof(KV, enable_prefix_caching), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject KVType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dynamo.engine_core._kv.KVManager",
    .tp_basicsize = sizeof(KV),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KV blocks of one DP rank (contract: _kv.pyi).",
    .tp_new = KV_new,
    .tp_dealloc = (destructor)KV_dealloc,
    .tp_methods = KV_methods,
    .tp_getset = KV_getset,
    .tp_members = KV_members,
};

/* ---- the admission calls for C callers (_kv_api.h) ------------------------------------- */

/* The last admitted chains' keys, by their leading hash objects (``dynamo/_id_memo.h``: the
 * offline replay's prompts of a prefix group share ~64 of their ~72 hash objects); the flag is
 * a key's sign. */
#define MEMO_BITS 7

static IdMemo key_memo[1 << MEMO_BITS];

static void
memo_clear(void *Py_UNUSED(module))
{
    id_memo_clear(key_memo, 1 << MEMO_BITS);
}

static void
api_keys_of(PyObject *const *items, Py_ssize_t n, uint64_t *keys, uint8_t *negs, uint8_t *ok)
{
    IdMemo *m = NULL;
    Py_ssize_t same = 0; /* leading items that are the memo's objects */
    if (n > 0) {
        m = id_memo_way(key_memo, MEMO_BITS, items[0]);
        same = id_memo_same(m, items, n);
        if (same > 0) {
            memcpy(keys, m->keys, (size_t)same * sizeof(uint64_t));
            memcpy(negs, m->flags, (size_t)same);
            memset(ok, 1, (size_t)same);
        }
    }
    Py_ssize_t converted = same; /* the leading run of converted keys */
    for (Py_ssize_t i = same; i < n; i++) {
        int rc = to_key(items[i], &keys[i], &negs[i]);
        if (rc < 0)
            PyErr_Clear(); /* as find(): not found */
        ok[i] = rc > 0;
        if (ok[i] && converted == i)
            converted++;
    }
    if (m != NULL && converted > same) /* a prefix group's next prompt shares it */
        id_memo_keep(m, items, keys, negs, same, converted);
}

static Py_ssize_t
api_cached_prefix(PyObject *self, const uint64_t *keys, const uint8_t *ok, int32_t *slots,
                  Py_ssize_t n)
{
    const KV *kv = (const KV *)self;
    Py_ssize_t i = 0;
    if (kv->enable_prefix_caching)
        while (i < n && ok[i] && slot_at(kv, keys, slots, i) >= 0)
            i++;
    return i;
}

static Py_ssize_t
api_slots_missing(PyObject *self, const uint64_t *keys, const uint8_t *ok, int32_t *slots,
                  Py_ssize_t n)
{
    const KV *kv = (const KV *)self;
    Py_ssize_t missing = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t s = ok[i] ? slot_at(kv, keys, slots, i) : -1;
        if (s < 0 || kv->e[s].refcount == 0)
            missing++;
    }
    return missing;
}

static int
api_caching(PyObject *self)
{
    return ((KV *)self)->enable_prefix_caching != 0;
}

static int
api_raw(PyObject *self)
{
    return ((KV *)self)->raw != 0;
}

static Py_ssize_t
api_available(PyObject *self)
{
    KV *kv = (KV *)self;
    return kv->num_blocks - num_active(kv);
}

static PyObject *
api_drain(PyObject *self, int raw)
{
    return raw ? KV_drain_raw_events((KV *)self, NULL) : KV_drain_events((KV *)self, NULL);
}

static DynKVApi kv_api = {
    &KVType,      api_keys_of,   api_cached_prefix, api_slots_missing, use_keys, promote_items,
    release_items, api_caching,  api_raw,           api_available,     allocate_n, api_drain,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kv",
    "KVManager as a native table (contract: _kv.pyi; fallback: _kv_fallback.py).",
    -1, NULL, NULL, NULL, NULL, memo_clear,
};

PyMODINIT_FUNC
PyInit__kv(void)
{
    if (PyType_Ready(&KVType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KVType);
    if (PyModule_AddObject(m, "KVManager", (PyObject *)&KVType) < 0) {
        Py_DECREF(&KVType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *api = PyCapsule_New(&kv_api, DYN_KV_API_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObject(m, "_C_API_4", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

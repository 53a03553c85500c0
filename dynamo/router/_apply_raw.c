/*
 * dynamo.router._apply_raw: the KV indexer's common raw events buffer (one rank's consecutive
 * events, ``dynamo/protocol/kv_raw.py``) decided, applied and counted in one call: its rank is
 * known, not recovering, and the buffer's first id is the rank's next one. ``KVIndexer.apply_raw``
 * (router/indexer.py) asks it first and takes its decoded path for anything else.
 *
 * Why native: the same decision in Python (the header's unpack, the rank lookup, the id check,
 * three counter updates, around the tree's one call) cost more than a small pass's tree work;
 * the offline replay applies ~2.4 such buffers a request.
 *
 * The rank state (``indexer._Rank``, a slotted dataclass) is read and written at its slot
 * offsets (``dynamo/_slots.h``); the event ids through ``dynamo/_u64.h``. The contract is
 * ``_apply_raw.pyi``; ``_apply_raw_fallback.py`` is the same in Python (``dynamo.native`` picks
 * one) and tests/unit/router/test_apply_raw_native.py holds the two to the same outcomes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "../_slots.h"
#include "../_u64.h"
#include "_radix_api.h"

static const char *const rank_fields[] = {"slot", "last_id", "recovering"};
enum { F_SLOT, F_LAST, F_RECOVERING };
static DynSlots rank_slots = DYN_SLOTS_OF(rank_fields);
static PyObject *str_apply_raw; /* "apply_raw", interned */
static const DynRadixApi *radix; /* the native tree's calls (NULL: not built; the method) */

#define RAW_HEADER 3 /* dp_rank, first_event_id, count */

/* The ranks dict's version tag: changed by every change of that dict (CPython < 3.12, where it
 * is a plain unique counter); the rank cache is only used where it exists. */
#if PY_VERSION_HEX < 0x030C0000
#define RANK_CACHE 64
#define DICT_VERSION(d) (((PyDictObject *)(d))->ma_version_tag)
#else
#define RANK_CACHE 0
#endif

/* A rank's state found for (worker, dp) while the ranks dict had version tag `version`. */
typedef struct {
    uint64_t worker, dp, version;
    PyObject *st; /* strong; NULL: empty */
} CachedRank;

typedef struct {
    PyObject_HEAD
    PyObject *ranks;    /* dict: (worker_id, dp_rank) -> the rank's state */
    PyObject *tree;     /* the index's tree: apply_raw(slot, raw) -> (ok, parent, block) */
    PyObject *counters; /* dict: status -> events */
    PyObject *keys[3];  /* the statuses OK, PARENT_BLOCK_NOT_FOUND, BLOCK_NOT_FOUND */
#if RANK_CACHE
    /* (worker, dp) -> state as last looked up, by a mix of the pair: a buffer's rank was a
     * tuple key built, hashed and compared with the dict's (~400 instructions a buffer) */
    CachedRank cache[RANK_CACHE];
#endif
} Applier;

static void
cache_clear(Applier *self)
{
#if RANK_CACHE
    for (int k = 0; k < RANK_CACHE; k++)
        Py_CLEAR(self->cache[k].st);
#endif
}

static int
Applier_init(Applier *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ranks", "tree", "counters", "ok", "parent", "block", NULL};
    PyObject *ranks, *tree, *counters, *ok, *parent, *block;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!OOO:InOrderApplier", kwlist, &PyDict_Type,
                                     &ranks, &tree, &PyDict_Type, &counters, &ok, &parent, &block))
        return -1;
    Py_XSETREF(self->ranks, Py_NewRef(ranks));
    Py_XSETREF(self->tree, Py_NewRef(tree));
    Py_XSETREF(self->counters, Py_NewRef(counters));
    Py_XSETREF(self->keys[0], Py_NewRef(ok));
    Py_XSETREF(self->keys[1], Py_NewRef(parent));
    Py_XSETREF(self->keys[2], Py_NewRef(block));
    cache_clear(self); /* another ranks dict may have the same version tag */
    return 0;
}

static int
Applier_traverse(Applier *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ranks);
    Py_VISIT(self->tree);
    Py_VISIT(self->counters);
    for (int k = 0; k < 3; k++)
        Py_VISIT(self->keys[k]);
#if RANK_CACHE
    for (int k = 0; k < RANK_CACHE; k++)
        Py_VISIT(self->cache[k].st);
#endif
    return 0;
}

static int
Applier_clear(Applier *self)
{
    Py_CLEAR(self->ranks);
    Py_CLEAR(self->tree);
    Py_CLEAR(self->counters);
    for (int k = 0; k < 3; k++)
        Py_CLEAR(self->keys[k]);
    cache_clear(self);
    return 0;
}

static void
Applier_dealloc(Applier *self)
{
    PyObject_GC_UnTrack(self);
    Applier_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An event id as a uint64: 1, or 0 (no exception) for anything that is not an int in range. */
static int
id_of(PyObject *v, uint64_t *out)
{
    if (dyn_u64_digits(v, out))
        return 1;
    if (!PyLong_Check(v))
        return 0;
    *out = DYN_AS_U64(v);
    if (*out == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* negative or too wide: the decoded path decides */
        return 0;
    }
    return 1;
}

/* counters[key] += n */
static int
count(PyObject *counters, PyObject *key, PyObject *n)
{
    PyObject *old = PyDict_GetItemWithError(counters, key); /* borrowed */
    if (old == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    PyObject *sum = PyNumber_Add(old, n);
    if (sum == NULL)
        return -1;
    int rc = PyDict_SetItem(counters, key, sum);
    Py_DECREF(sum);
    return rc;
}

static PyObject *
Applier_apply(Applier *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "apply(worker_id, raw)");
        return NULL;
    }
    if (self->ranks == NULL) {
        PyErr_SetString(PyExc_ValueError, "InOrderApplier not initialised");
        return NULL;
    }
    PyObject *worker_id = args[0], *raw = args[1];
    if (!PyBytes_Check(raw)) {
        PyErr_SetString(PyExc_TypeError, "raw events are bytes");
        return NULL;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(raw);
    if (len == 0)
        Py_RETURN_TRUE;
    if (len < RAW_HEADER * 8) /* no header: the decoded path raises */
        Py_RETURN_FALSE;
    uint64_t w[RAW_HEADER];
    memcpy(w, PyBytes_AS_STRING(raw), sizeof w);
    uint64_t first = w[1], n = w[2];
    if (n == 0 || first > UINT64_MAX - n + 1) /* the new last id is not a uint64: decoded */
        Py_RETURN_FALSE;
    PyObject *st = NULL;
#if RANK_CACHE
    uint64_t worker;
    /* an exact int's value: the dict's equality for such a key (anything else is looked up) */
    int cacheable = dyn_u64_digits(worker_id, &worker);
    CachedRank *c = NULL;
    if (cacheable) {
        uint64_t x = (worker ^ (w[0] * 0x9E3779B97F4A7C15ULL)) * 0xBF58476D1CE4E5B9ULL;
        c = &self->cache[(x >> 32) & (RANK_CACHE - 1)];
        if (c->st != NULL && c->version == DICT_VERSION(self->ranks) && c->worker == worker &&
            c->dp == w[0])
            st = Py_NewRef(c->st);
    }
#endif
    if (st == NULL) {
        PyObject *dp = PyLong_FromUnsignedLongLong(w[0]);
        if (dp == NULL)
            return NULL;
        PyObject *key = PyTuple_Pack(2, worker_id, dp);
        Py_DECREF(dp);
        if (key == NULL)
            return NULL;
        st = PyDict_GetItemWithError(self->ranks, key); /* borrowed */
        Py_DECREF(key);
        if (st == NULL) {
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_FALSE; /* an unknown rank: created on the decoded path */
        }
        Py_INCREF(st);
#if RANK_CACHE
        if (c != NULL) {
            c->worker = worker;
            c->dp = w[0];
            c->version = DICT_VERSION(self->ranks);
            Py_XSETREF(c->st, Py_NewRef(st));
        }
#endif
    }
    PyObject *result = NULL, *slot = NULL, *counts = NULL, *last = NULL;
    PyObject *v = dyn_slots_get(&rank_slots, st, F_RECOVERING);
    if (v == NULL)
        goto done;
    int recovering = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (recovering < 0)
        goto done;
    if (recovering) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    if ((v = dyn_slots_get(&rank_slots, st, F_LAST)) == NULL)
        goto done;
    uint64_t last_id;
    int known = id_of(v, &last_id);
    Py_DECREF(v);
    if (!known || last_id == UINT64_MAX || first != last_id + 1) {
        result = Py_NewRef(Py_False); /* no id yet, or not the next one */
        goto done;
    }
    if ((slot = dyn_slots_get(&rank_slots, st, F_SLOT)) == NULL)
        goto done;
    Py_ssize_t native[3];
    if (radix != NULL && Py_IS_TYPE(self->tree, radix->type)) { /* no method call, no tuple */
        if (radix->apply_raw(self->tree, slot, raw, native) < 0)
            goto done;
    }
    else {
        PyObject *call[3] = {self->tree, slot, raw};
        counts = PyObject_VectorcallMethod(str_apply_raw, call,
                                           3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (counts == NULL)
            goto done;
        if (!PyTuple_Check(counts) || PyTuple_GET_SIZE(counts) != 3) {
            PyErr_SetString(PyExc_TypeError, "tree.apply_raw returns (ok, parent, block)");
            goto done;
        }
    }
    if ((last = PyLong_FromUnsignedLongLong(first + n - 1)) == NULL)
        goto done;
    if (dyn_slots_put(&rank_slots, st, F_LAST, last) < 0)
        goto done;
    for (int k = 0; k < 3; k++) {
        if (counts == NULL) {
            if (native[k] == 0)
                continue;
            PyObject *c = PyLong_FromSsize_t(native[k]);
            int rc = c == NULL ? -1 : count(self->counters, self->keys[k], c);
            Py_XDECREF(c);
            if (rc < 0)
                goto done;
            continue;
        }
        PyObject *c = PyTuple_GET_ITEM(counts, k);
        int zero = PyLong_CheckExact(c) && Py_SIZE(c) == 0;
        if (!zero && count(self->counters, self->keys[k], c) < 0)
            goto done;
    }
    result = Py_NewRef(Py_True);
done:
    Py_DECREF(st);
    Py_XDECREF(slot);
    Py_XDECREF(counts);
    Py_XDECREF(last);
    return result;
}

static PyMethodDef Applier_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))Applier_apply, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ApplierType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dynamo.router._apply_raw.InOrderApplier",
    .tp_basicsize = sizeof(Applier),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A KV indexer's in-order raw buffers applied in one call (contract: _apply_raw.pyi).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Applier_init,
    .tp_dealloc = (destructor)Applier_dealloc,
    .tp_traverse = (traverseproc)Applier_traverse,
    .tp_clear = (inquiry)Applier_clear,
    .tp_methods = Applier_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_apply_raw",
    "A KV indexer's in-order raw events buffer in one call (contract: _apply_raw.pyi; fallback: "
    "_apply_raw_fallback.py).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__apply_raw(void)
{
    if (PyType_Ready(&ApplierType) < 0)
        return NULL;
    if (dyn_slots_init(&rank_slots) < 0)
        return NULL;
    if ((str_apply_raw = PyUnicode_InternFromString("apply_raw")) == NULL)
        return NULL;
    if ((radix = PyCapsule_Import(DYN_RADIX_API_CAPSULE, 0)) == NULL)
        PyErr_Clear(); /* the native tree is not built: its method is called */
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ApplierType);
    if (PyModule_AddObject(m, "InOrderApplier", (PyObject *)&ApplierType) < 0) {
        Py_DECREF(&ApplierType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

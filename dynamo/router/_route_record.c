/*
 * dynamo.router._route_record: the KV router's common request (every target eligible, temperature
 * 0, no busy thresholds, the index's exact matches, the load accounting's prefix keys) routed and
 * recorded in one call: the index's matches by slot, the request's new blocks on each target,
 * the route kernel's choice (``_route.choose``), the ``Selection`` and the record on the chosen
 * rank (``ActiveSequences.add_routed``, as the function ``sequences.add_routed``). ``RoutingCore.route`` (router/core.py) keeps one
 * ``RouteRecorder`` per membership, live and in the offline replay.
 *
 * Why native: the same glue in Python (``RoutingCore._choose``: the argument checks, the slot
 * map, the resolved ranks, the kernel's ten arguments, the ``Selection``) was a few Python frames
 * and ~100 bytecodes a request around C calls. Everything the glue looked up per request is held
 * here once; the rank list's validity is checked by identity (``ActiveSequences._columns_for``,
 * read at its slot offset, ``dynamo/_slots.h``).
 *
 * The contract is ``_route_record.pyi``; ``_route_record_fallback.py`` is the same in Python
 * (``dynamo.native`` picks one) and tests/unit/router/test_route_record_native.py holds the two,
 * and the Python route, to the same choices and loads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../_slots.h"

static const char *const seq_fields[] = {"_columns_for"};
static DynSlots seq_slots = DYN_SLOTS_OF(seq_fields);

enum { N_HELD = 16, TRACK = 14 };
typedef struct {
    PyObject_HEAD
    /* in the constructor's order */
    PyObject *find, *key_of, *place_of, *keys, *ranks, *tables, *resolved, *sequences, *add;
    PyObject *new_blocks, *choose, *selection, *params, *rng, *track, *bs;
    long long block_size;
} Recorder;

#define HELD(self) (&(self)->find)

static int
Recorder_init(Recorder *self, PyObject *args, PyObject *kwds)
{
    PyObject *a[N_HELD];
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "RouteRecorder takes positional arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!OOOOOOO!OOO:RouteRecorder", &a[0], &PyList_Type,
                          &a[1], &PyDict_Type, &a[2], &PyList_Type, &a[3], &PyList_Type, &a[4],
                          &PyList_Type, &a[5], &a[6], &a[7], &a[8], &a[9], &a[10], &a[11],
                          &PyTuple_Type, &a[12], &a[13], &a[14], &a[15]))
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(a[4]);
    if (n == 0 || PyList_GET_SIZE(a[3]) != n || PyList_GET_SIZE(a[5]) != n) {
        PyErr_SetString(PyExc_ValueError,
                        "keys, ranks and tables: one each per target, at least one");
        return -1;
    }
    long long bs = PyLong_AsLongLong(a[15]);
    if (bs == -1 && PyErr_Occurred())
        return -1;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0");
        return -1;
    }
    int track = PyObject_IsTrue(a[TRACK]);
    if (track < 0)
        return -1;
    PyObject **held = HELD(self);
    for (int k = 0; k < N_HELD; k++)
        Py_XSETREF(held[k], Py_NewRef(k == TRACK ? (track ? Py_True : Py_False) : a[k]));
    self->block_size = bs;
    return 0;
}

static int
Recorder_traverse(Recorder *self, visitproc visit, void *arg)
{
    PyObject **held = HELD(self);
    for (int k = 0; k < N_HELD; k++)
        Py_VISIT(held[k]);
    return 0;
}

static int
Recorder_clear(Recorder *self)
{
    PyObject **held = HELD(self);
    for (int k = 0; k < N_HELD; k++)
        Py_CLEAR(held[k]);
    return 0;
}

static void
Recorder_dealloc(Recorder *self)
{
    PyObject_GC_UnTrack(self);
    Recorder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An exact int as a long long: 1, or 0 (no exception) for anything else or out of range. */
static int
small_int(PyObject *v, long long *out)
{
    if (!PyLong_CheckExact(v))
        return 0;
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return *out > -(1LL << 40) && *out < (1LL << 40);
}

static PyObject *
Recorder_route(Recorder *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "route(request_id, local_hashes, seq_hashes, isl_tokens, prefix_keys, "
                        "record)");
        return NULL;
    }
    if (self->sequences == NULL) {
        PyErr_SetString(PyExc_ValueError, "RouteRecorder not initialised");
        return NULL;
    }
    PyObject *request_id = args[0], *local = args[1], *seqs = args[2], *isl = args[3];
    PyObject *prefix_keys = args[4];
    int record = PyObject_IsTrue(args[5]);
    if (record < 0)
        return NULL;
    PyObject *resolved = dyn_slots_get(&seq_slots, self->sequences, 0);
    if (resolved == NULL)
        return NULL;
    Py_DECREF(resolved); /* compared by identity only: the sequences object keeps it */
    if (resolved != self->resolved)
        Py_RETURN_NONE; /* the ranks changed since: the caller routes and builds a new one */
    long long isl_ll;
    if (!small_int(isl, &isl_ll))
        Py_RETURN_NONE; /* an unusual token count: the caller's Python route */

    PyObject *matches = NULL, *new = NULL, *res = NULL, *chosen = NULL, *out = NULL;
    int nonempty = PyObject_IsTrue(local);
    if (nonempty < 0)
        return NULL;
    matches = nonempty ? PyObject_Vectorcall(self->find, &local, 1, NULL) : PyDict_New();
    if (matches == NULL)
        goto done;
    PyObject *nb_args[2] = {self->tables, prefix_keys};
    if ((new = PyObject_Vectorcall(self->new_blocks, nb_args, 2, NULL)) == NULL)
        goto done;
    PyObject *ch_args[10] = {matches,    self->key_of, self->place_of, self->ranks, new,
                             isl,        self->bs,     self->params,   self->rng,   self->track};
    if ((res = PyObject_Vectorcall(self->choose, ch_args, 10, NULL)) == NULL)
        goto done;
    if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 3) {
        PyErr_SetString(PyExc_TypeError, "choose returns (place, overlap, costs)");
        goto done;
    }
    PyObject *place = PyTuple_GET_ITEM(res, 0), *overlap = PyTuple_GET_ITEM(res, 1);
    PyObject *costs = PyTuple_GET_ITEM(res, 2);
    Py_ssize_t i = PyLong_AsSsize_t(place);
    if (i == -1 && PyErr_Occurred())
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(self->keys);
    if (i < 0 || i >= n || PyList_GET_SIZE(self->ranks) != n || !PyList_Check(costs) ||
        PyList_GET_SIZE(costs) != n) {
        PyErr_SetString(PyExc_IndexError, "the chosen place is outside the targets");
        goto done;
    }
    PyObject *key = PyList_GET_ITEM(self->keys, i);
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
        PyErr_SetString(PyExc_TypeError, "a target key is a (worker_id, dp_rank) tuple");
        goto done;
    }
    long long ov;
    if (!small_int(overlap, &ov)) {
        PyErr_SetString(PyExc_ValueError, "the overlap is not a block count");
        goto done;
    }
    long long cap = isl_ll > 0 ? isl_ll : 0, cached = cap;
    if (ov <= 0 || self->block_size <= cap / ov) /* else the product is past cap anyway */
        cached = ov * self->block_size < cap ? ov * self->block_size : cap;
    PyObject *cached_obj = PyLong_FromLongLong(cached);
    if (cached_obj == NULL)
        goto done;
    PyObject *sel_args[7] = {PyTuple_GET_ITEM(key, 0), PyTuple_GET_ITEM(key, 1),
                             PyList_GET_ITEM(costs, i), overlap, cached_obj, self->keys, costs};
    chosen = PyObject_Vectorcall(self->selection, sel_args, 7, NULL);
    Py_DECREF(cached_obj);
    if (chosen == NULL)
        goto done;
    if (record) {
        PyObject *add_args[7] = {self->sequences, request_id, PyList_GET_ITEM(self->ranks, i),
                                 seqs,            isl,        overlap,
                                 prefix_keys};
        PyObject *added = PyObject_Vectorcall(self->add, add_args, 7, NULL);
        if (added == NULL)
            goto done;
        Py_DECREF(added);
    }
    out = Py_NewRef(chosen);
done:
    Py_XDECREF(matches);
    Py_XDECREF(new);
    Py_XDECREF(res);
    Py_XDECREF(chosen);
    return out;
}

static PyMethodDef Recorder_methods[] = {
    {"route", (PyCFunction)(void (*)(void))Recorder_route, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dynamo.router._route_record.RouteRecorder",
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The KV router's common request routed and recorded (contract: _route_record.pyi).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Recorder_init,
    .tp_dealloc = (destructor)Recorder_dealloc,
    .tp_traverse = (traverseproc)Recorder_traverse,
    .tp_clear = (inquiry)Recorder_clear,
    .tp_methods = Recorder_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_route_record",
    "The KV router's common request routed and recorded in one call (contract: "
    "_route_record.pyi; fallback: _route_record_fallback.py).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__route_record(void)
{
    if (PyType_Ready(&RecorderType) < 0)
        return NULL;
    if (dyn_slots_init(&seq_slots) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RecorderType);
    if (PyModule_AddObject(m, "RouteRecorder", (PyObject *)&RecorderType) < 0) {
        Py_DECREF(&RecorderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

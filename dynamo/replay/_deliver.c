/*
 * dynamo.replay._deliver: a replay pass's tokens into its requests' records, in one call.
 *
 * ``deliver(tokens, by_id, now)``: for each ``(seq, token)`` of a pass that ends at ``now``,
 * the request ``by_id[seq.request_id]`` (skipped when absent: abandoned while the pass ran)
 * gets its first token (``record.ttft = now - record.start``) or its next gap
 * (``record.itl.append(now - flight.last_token_at)``), then ``flight.last_token_at = now`` and
 * ``record.output_tokens += 1``. Returns the flights whose first token this was, in order (the
 * router's prefill-completed), or None when there are none.
 *
 * Why native: every output token of a replay goes through this accounting (640,000 in the
 * 20k-request benchmark, 2.2 million at 100 workers), and in Python it was ~5 % of the run
 * (docs/performance.md, "Offline replay"). An earlier try through the generic attribute API
 * gained nothing (CPython 3.11's specialised slot loads are as fast); here the slotted
 * dataclasses' fields are read and written in place at their member descriptors' offsets,
 * learned once per class (``dynamo/_slots.h``; any other class goes through getattr /
 * setattr, same results).
 *
 * The contract is ``_deliver.pyi``; ``_deliver_fallback.py`` is the same loop in Python
 * (``dynamo.native`` picks one) and tests/unit/replay/test_deliver_native.py holds the two to
 * the same records on random passes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "../_slots.h"

/* -- the fields it reads and writes, at their slot offsets (dynamo/_slots.h) -------------- */

static const char *const seq_fields[] = {"request_id"};
static const char *const flight_fields[] = {"record", "last_token_at"};
static const char *const record_fields[] = {"start", "ttft", "itl", "output_tokens"};
enum { SEQ_REQUEST_ID = 0 };
enum { FL_RECORD = 0, FL_LAST_TOKEN_AT = 1 };
enum { RC_START = 0, RC_TTFT = 1, RC_ITL = 2, RC_OUTPUT = 3 };
static DynSlots seq_slots = DYN_SLOTS_OF(seq_fields), flight_slots = DYN_SLOTS_OF(flight_fields),
                record_slots = DYN_SLOTS_OF(record_fields);
static PyObject *one; /* the int 1 */

/* Set a field to the new reference ``v`` (stolen; NULL: the error that made it). */
static int
put_new(DynSlots *l, PyObject *obj, int f, PyObject *v)
{
    if (v == NULL)
        return -1;
    int rc = dyn_slots_put(l, obj, f, v);
    Py_DECREF(v);
    return rc;
}

/* ``a - b`` as Python computes it (a new reference, NULL on error): two floats directly. */
static PyObject *
minus(PyObject *a, PyObject *b)
{
    if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b))
        return PyFloat_FromDouble(PyFloat_AS_DOUBLE(a) - PyFloat_AS_DOUBLE(b));
    return PyNumber_Subtract(a, b);
}

/* The last gap computed in this call and the ``last_token_at`` it was computed from (strong
 * references): a decode pass's requests mostly had their previous token at the same instant,
 * the rank's previous pass end, stored in each as the same float object, so their gaps are the
 * same float and one object serves them all (the values are what each subtraction gives;
 * floats are immutable). Fewer objects allocated a token, and the ITL lists, read back by the
 * report, point at a few shared floats instead of one each. */
typedef struct {
    PyObject *last, *gap;
} GapCache;

/* ``now - last`` for a gap: the cached object when ``last`` is the cached instant itself. */
static PyObject *
gap_of(GapCache *cache, PyObject *now, PyObject *last)
{
    if (last == cache->last)
        return Py_NewRef(cache->gap);
    PyObject *gap = minus(now, last);
    if (gap != NULL && PyFloat_CheckExact(last) && PyFloat_CheckExact(gap)) {
        Py_XSETREF(cache->last, Py_NewRef(last));
        Py_XSETREF(cache->gap, Py_NewRef(gap));
    }
    return gap;
}

/* One token of ``flight`` at ``now``: 1 if it was the first, 0 if not, -1 on error. */
static int
one_token(PyObject *flight, PyObject *now, GapCache *cache)
{
    int first = 0;
    PyObject *record = dyn_slots_get(&flight_slots, flight, FL_RECORD);
    if (record == NULL)
        return -1;
    PyObject *ttft = dyn_slots_get(&record_slots, record, RC_TTFT);
    if (ttft == NULL)
        goto fail;
    Py_DECREF(ttft); /* identity only (None or not) */
    if (ttft == Py_None) {
        PyObject *start = dyn_slots_get(&record_slots, record, RC_START);
        if (start == NULL)
            goto fail;
        int rc = put_new(&record_slots, record, RC_TTFT, minus(now, start));
        Py_DECREF(start);
        if (rc < 0)
            goto fail;
        first = 1;
    }
    else {
        PyObject *last = dyn_slots_get(&flight_slots, flight, FL_LAST_TOKEN_AT);
        if (last == NULL)
            goto fail;
        PyObject *gap = gap_of(cache, now, last);
        Py_DECREF(last);
        if (gap == NULL)
            goto fail;
        PyObject *itl = dyn_slots_get(&record_slots, record, RC_ITL);
        if (itl == NULL) {
            Py_DECREF(gap);
            goto fail;
        }
        int rc;
        if (PyList_CheckExact(itl))
            rc = PyList_Append(itl, gap);
        else {
            PyObject *r = PyObject_CallMethod(itl, "append", "O", gap);
            rc = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        }
        Py_DECREF(itl);
        Py_DECREF(gap);
        if (rc < 0)
            goto fail;
    }
    if (put_new(&flight_slots, flight, FL_LAST_TOKEN_AT, Py_NewRef(now)) < 0)
        goto fail;
    PyObject *n = dyn_slots_get(&record_slots, record, RC_OUTPUT);
    if (n == NULL)
        goto fail;
    PyObject *n1;
    long small = PyLong_CheckExact(n) ? PyLong_AsLong(n) : -1;
    if (small >= 0 && small < LONG_MAX)
        n1 = PyLong_FromLong(small + 1);
    else {
        PyErr_Clear(); /* an overflow or another type: Python's + decides */
        n1 = PyNumber_Add(n, one);
    }
    Py_DECREF(n);
    if (put_new(&record_slots, record, RC_OUTPUT, n1) < 0)
        goto fail;
    Py_DECREF(record);
    return first;
fail:
    Py_DECREF(record);
    return -1;
}

static PyObject *
deliver(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "deliver(tokens, by_id, now)");
        return NULL;
    }
    PyObject *tokens = args[0], *by_id = args[1];
    if (!PyList_CheckExact(tokens) || !PyDict_CheckExact(by_id)) {
        PyErr_SetString(PyExc_TypeError, "deliver: tokens must be a list, by_id a dict");
        return NULL;
    }
    PyObject *now = args[2]; /* stored as is in every flight, as ``= now`` does */
    PyObject *firsts = NULL;
    GapCache cache = {NULL, NULL};
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tokens); i++) {
        PyObject *item = PyList_GET_ITEM(tokens, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "deliver: a token is a (sequence, id) pair");
            goto fail;
        }
        PyObject *seq = PyTuple_GET_ITEM(item, 0);
        PyObject *rid = dyn_slots_get(&seq_slots, seq, SEQ_REQUEST_ID);
        if (rid == NULL)
            goto fail;
        PyObject *flight = PyDict_GetItemWithError(by_id, rid); /* borrowed */
        Py_DECREF(rid);
        if (flight == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue; /* abandoned while the pass ran */
        }
        Py_INCREF(flight); /* the dict may change under a setattr's side effects */
        int first = one_token(flight, now, &cache);
        if (first == 1) {
            if (firsts == NULL && (firsts = PyList_New(0)) == NULL)
                first = -1;
            else if (PyList_Append(firsts, flight) < 0)
                first = -1;
        }
        Py_DECREF(flight);
        if (first < 0)
            goto fail;
    }
    Py_XDECREF(cache.last);
    Py_XDECREF(cache.gap);
    if (firsts == NULL)
        Py_RETURN_NONE;
    return firsts;
fail:
    Py_XDECREF(cache.last);
    Py_XDECREF(cache.gap);
    Py_XDECREF(firsts);
    return NULL;
}

static PyMethodDef methods[] = {
    {"deliver", (PyCFunction)(void (*)(void))deliver, METH_FASTCALL,
     "deliver(tokens, by_id, now): a pass's tokens into the requests' records; the flights "
     "that got their first token (None if none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dynamo.replay._deliver",
    "A replay pass's tokens into its requests' records (contract: _deliver.pyi).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__deliver(void)
{
    if ((one == NULL && (one = PyLong_FromLong(1)) == NULL) || dyn_slots_init(&seq_slots) < 0 ||
        dyn_slots_init(&flight_slots) < 0 || dyn_slots_init(&record_slots) < 0)
        return NULL;
    return PyModule_Create(&module);
}

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
 * learned once per class (any other class goes through getattr / setattr, same results).
 *
 * The contract is ``_deliver.pyi``; ``_deliver_fallback.py`` is the same loop in Python
 * (``dynamo.native`` picks one) and tests/unit/replay/test_deliver_native.py holds the two to
 * the same records on random passes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

/* -- slotted classes: a field read or written at its offset ------------------------------- */

enum { SEQ_REQUEST_ID, FL_RECORD, FL_LAST_TOKEN_AT, RC_START, RC_TTFT, RC_ITL, RC_OUTPUT, NF };

static const char *const field_names[NF] = {
    "request_id", "record", "last_token_at", "start", "ttft", "itl", "output_tokens",
};
static PyObject *names[NF];
static PyObject *one; /* the int 1 */

/* The class whose offsets are known (one of each role: a replay has one class of each). */
typedef struct {
    PyTypeObject *type;     /* strong reference, NULL until learned */
    PyTypeObject *refused;  /* strong reference: the last class that is not plain slots */
    Py_ssize_t offsets[NF];
} Layout;

static Layout seq_layout, flight_layout, record_layout;

/* Learn the offsets of fields [first, last) of ``type`` if each is a plain writable object slot
 * (otherwise that class goes through getattr / setattr). The first such class is kept. */
static void
learn(Layout *layout, PyTypeObject *type, int first, int last)
{
    if (layout->type != NULL || type == layout->refused)
        return;
    Py_ssize_t found[NF];
    for (int k = first; k < last; k++) {
        PyObject *d = PyObject_GetAttr((PyObject *)type, names[k]);
        if (d == NULL) {
            PyErr_Clear();
            goto refuse;
        }
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type);
        if (ok) {
            PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
            ok = m->type == T_OBJECT_EX && !(m->flags & READONLY);
            found[k] = m->offset;
        }
        Py_DECREF(d);
        if (!ok)
            goto refuse;
    }
    memcpy(layout->offsets + first, found + first, sizeof(Py_ssize_t) * (size_t)(last - first));
    layout->type = (PyTypeObject *)Py_NewRef(type);
    return;
refuse:
    Py_XSETREF(layout->refused, (PyTypeObject *)Py_NewRef(type));
}

/* A field's value (new reference), or NULL with an exception. */
static PyObject *
get(Layout *layout, PyObject *obj, int f)
{
    if (Py_TYPE(obj) == layout->type) {
        PyObject *v = *(PyObject **)((char *)obj + layout->offsets[f]);
        if (v == NULL) {
            PyErr_Format(PyExc_AttributeError, "%U", names[f]);
            return NULL;
        }
        return Py_NewRef(v);
    }
    return PyObject_GetAttr(obj, names[f]);
}

/* Set a field to the new reference ``v`` (stolen; NULL: the error that made it). */
static int
put_new(Layout *layout, PyObject *obj, int f, PyObject *v)
{
    if (v == NULL)
        return -1;
    if (Py_TYPE(obj) == layout->type) {
        PyObject **slot = (PyObject **)((char *)obj + layout->offsets[f]);
        PyObject *old = *slot;
        *slot = v;
        Py_XDECREF(old);
        return 0;
    }
    int rc = PyObject_SetAttr(obj, names[f], v);
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

/* One token of ``flight`` at ``now``: 1 if it was the first, 0 if not, -1 on error. */
static int
one_token(PyObject *flight, PyObject *now)
{
    int first = 0;
    PyObject *record = get(&flight_layout, flight, FL_RECORD);
    if (record == NULL)
        return -1;
    learn(&record_layout, Py_TYPE(record), RC_START, NF);
    PyObject *ttft = get(&record_layout, record, RC_TTFT);
    if (ttft == NULL)
        goto fail;
    Py_DECREF(ttft); /* identity only (None or not) */
    if (ttft == Py_None) {
        PyObject *start = get(&record_layout, record, RC_START);
        if (start == NULL)
            goto fail;
        int rc = put_new(&record_layout, record, RC_TTFT, minus(now, start));
        Py_DECREF(start);
        if (rc < 0)
            goto fail;
        first = 1;
    }
    else {
        PyObject *last = get(&flight_layout, flight, FL_LAST_TOKEN_AT);
        if (last == NULL)
            goto fail;
        PyObject *gap = minus(now, last);
        Py_DECREF(last);
        if (gap == NULL)
            goto fail;
        PyObject *itl = get(&record_layout, record, RC_ITL);
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
    if (put_new(&flight_layout, flight, FL_LAST_TOKEN_AT, Py_NewRef(now)) < 0)
        goto fail;
    PyObject *n = get(&record_layout, record, RC_OUTPUT);
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
    if (put_new(&record_layout, record, RC_OUTPUT, n1) < 0)
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
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tokens); i++) {
        PyObject *item = PyList_GET_ITEM(tokens, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "deliver: a token is a (sequence, id) pair");
            goto fail;
        }
        PyObject *seq = PyTuple_GET_ITEM(item, 0);
        learn(&seq_layout, Py_TYPE(seq), SEQ_REQUEST_ID, SEQ_REQUEST_ID + 1);
        PyObject *rid = get(&seq_layout, seq, SEQ_REQUEST_ID);
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
        learn(&flight_layout, Py_TYPE(flight), FL_RECORD, FL_LAST_TOKEN_AT + 1);
        int first = one_token(flight, now);
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
    if (firsts == NULL)
        Py_RETURN_NONE;
    return firsts;
fail:
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
    if (one == NULL && (one = PyLong_FromLong(1)) == NULL)
        return NULL;
    for (int k = 0; k < NF; k++)
        if (names[k] == NULL && (names[k] = PyUnicode_InternFromString(field_names[k])) == NULL)
            return NULL;
    return PyModule_Create(&module);
}

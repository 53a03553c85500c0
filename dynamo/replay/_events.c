/*
 * dynamo.replay._events: the replay's event queue, a binary heap of (when, kind, order, payload)
 * ordered by when, then kind, then order.
 *
 * Why native: every simulated pass is at least one push and one pop. heapq compares its tuples
 * through the generic rich comparison (a float, then on a tie the next items), ~40-60 ns a
 * comparison and ~17 of them per push + pop at 100 busy ranks: ~1 µs an event, ~4 % of the
 * 100-worker replay (docs/performance.md, "Offline replay"). Here an entry is a double, two
 * 64-bit ints and a reference, compared as such.
 *
 * The contract is ``_events.pyi``; ``_events_fallback.py`` is the same over heapq
 * (``dynamo.native`` picks one) and tests/unit/replay/test_events_native.py holds the two to the
 * same order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

typedef struct {
    double when;
    long long kind;
    long long order;
    PyObject *payload;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *heap;
    Py_ssize_t len, cap;
} Queue;

static inline int
before(const Entry *a, const Entry *b)
{
    if (a->when != b->when)
        return a->when < b->when;
    if (a->kind != b->kind)
        return a->kind < b->kind;
    return a->order < b->order;
}

static PyObject *
Queue_push(Queue *q, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "push(when, kind, order, payload)");
        return NULL;
    }
    Entry e;
    e.when = PyFloat_AsDouble(args[0]);
    if (e.when == -1.0 && PyErr_Occurred())
        return NULL;
    if (isnan(e.when)) {
        PyErr_SetString(PyExc_ValueError, "an event's time must not be NaN");
        return NULL;
    }
    e.kind = PyLong_AsLongLong(args[1]);
    if (e.kind == -1 && PyErr_Occurred())
        return NULL;
    e.order = PyLong_AsLongLong(args[2]);
    if (e.order == -1 && PyErr_Occurred())
        return NULL;
    if (q->len == q->cap) {
        Py_ssize_t cap = q->cap ? q->cap * 2 : 64;
        Entry *grown = PyMem_Realloc(q->heap, (size_t)cap * sizeof(Entry));
        if (grown == NULL)
            return PyErr_NoMemory();
        q->heap = grown;
        q->cap = cap;
    }
    Py_INCREF(args[3]);
    e.payload = args[3];
    Py_ssize_t i = q->len++;
    while (i > 0) { /* sift up */
        Py_ssize_t parent = (i - 1) / 2;
        if (!before(&e, &q->heap[parent]))
            break;
        q->heap[i] = q->heap[parent];
        i = parent;
    }
    q->heap[i] = e;
    Py_RETURN_NONE;
}

static PyObject *
Queue_pop(Queue *q, PyObject *Py_UNUSED(ignored))
{
    if (q->len == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty event queue");
        return NULL;
    }
    Entry top = q->heap[0];
    Entry last = q->heap[--q->len];
    Py_ssize_t i = 0, n = q->len;
    for (;;) { /* sift the last entry down from the root */
        Py_ssize_t child = 2 * i + 1;
        if (child >= n)
            break;
        if (child + 1 < n && before(&q->heap[child + 1], &q->heap[child]))
            child++;
        if (!before(&q->heap[child], &last))
            break;
        q->heap[i] = q->heap[child];
        i = child;
    }
    if (n > 0)
        q->heap[i] = last;
    PyObject *when = PyFloat_FromDouble(top.when);
    PyObject *kind = PyLong_FromLongLong(top.kind);
    if (when == NULL || kind == NULL) {
        Py_XDECREF(when);
        Py_XDECREF(kind);
        Py_DECREF(top.payload);
        return NULL;
    }
    PyObject *out = PyTuple_New(3);
    if (out == NULL) {
        Py_DECREF(when);
        Py_DECREF(kind);
        Py_DECREF(top.payload);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, when);
    PyTuple_SET_ITEM(out, 1, kind);
    PyTuple_SET_ITEM(out, 2, top.payload); /* the queue's reference moves to the tuple */
    return out;
}

static PyObject *
Queue_next_when(Queue *q, PyObject *Py_UNUSED(ignored))
{
    return PyFloat_FromDouble(q->len ? q->heap[0].when : INFINITY);
}

static Py_ssize_t
Queue_len(Queue *q)
{
    return q->len;
}

static int
Queue_traverse(Queue *q, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < q->len; i++)
        Py_VISIT(q->heap[i].payload);
    return 0;
}

static int
Queue_clear(Queue *q)
{
    Py_ssize_t n = q->len;
    q->len = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        Py_CLEAR(q->heap[i].payload);
    return 0;
}

static void
Queue_dealloc(Queue *q)
{
    PyObject_GC_UnTrack(q);
    Queue_clear(q);
    PyMem_Free(q->heap);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyObject *
Queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "EventQueue() takes no arguments");
        return NULL;
    }
    Queue *q = (Queue *)type->tp_alloc(type, 0);
    if (q == NULL)
        return NULL;
    q->heap = NULL;
    q->len = q->cap = 0;
    return (PyObject *)q;
}

static PyMethodDef Queue_methods[] = {
    {"push", (PyCFunction)(void (*)(void))Queue_push, METH_FASTCALL,
     "push(when, kind, order, payload): queue an event."},
    {"pop", (PyCFunction)Queue_pop, METH_NOARGS,
     "pop(): (when, kind, payload) of the first event; IndexError when empty."},
    {"next_when", (PyCFunction)Queue_next_when, METH_NOARGS,
     "next_when(): the first event's time, inf when empty."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Queue_as_sequence = {
    .sq_length = (lenfunc)Queue_len,
};

static PyTypeObject QueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dynamo.replay._events.EventQueue",
    .tp_doc = PyDoc_STR("EventQueue(): events by (when, kind, order), first out first."),
    .tp_basicsize = sizeof(Queue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Queue_new,
    .tp_dealloc = (destructor)Queue_dealloc,
    .tp_traverse = (traverseproc)Queue_traverse,
    .tp_clear = (inquiry)Queue_clear,
    .tp_as_sequence = &Queue_as_sequence,
    .tp_methods = Queue_methods,
};

static struct PyModuleDef events_module = {
    PyModuleDef_HEAD_INIT, "dynamo.replay._events",
    "The replay's event queue in C (see _events.pyi).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__events(void)
{
    if (PyType_Ready(&QueueType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&events_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&QueueType);
    if (PyModule_AddObject(module, "EventQueue", (PyObject *)&QueueType) < 0) {
        Py_DECREF(&QueueType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

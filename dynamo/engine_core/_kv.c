/*
 * dynamo.engine_core._kv: the per-block loops of KVManager's accounting (FACTS §6.3), over the
 * manager's own containers.
 *
 * Why native: every admission probes its prompt's blocks twice (cached prefix, slots needed)
 * and references its cached ones, every finished or preempted request releases each of its
 * blocks, and every allocation may evict inactive blocks one by one. In Python those loops were ~11 % of the offline replay's
 * CPU (docs/performance.md, "Offline replay"), and the live mocker and the PyTorch engine run
 * the same KV manager. The containers stay Python objects owned by KVManager (a dict of
 * refcounts, an OrderedDict as the LRU inactive pool, ...): these functions only walk them, so
 * the manager keeps one state whichever implementation runs. The inactive pool is written
 * through the mapping protocol (PyObject_SetItem / DelItem, its popitem method), never the dict
 * API, which would bypass OrderedDict's order.
 *
 * The contract is ``_kv.pyi``; ``_kv_fallback.py`` is the same in Python (``dynamo.native`` picks
 * one) and tests/unit/engine_core/test_kv_kernels.py holds the two to the same outputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_popitem;

static int
check_dict(PyObject *obj, const char *name)
{
    if (!PyDict_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict", name);
        return -1;
    }
    return 0;
}

/* cached_prefix(active, inactive, hashes): leading hashes present in either. */
static PyObject *
cached_prefix(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "cached_prefix(active, inactive, hashes)");
        return NULL;
    }
    PyObject *active = args[0], *inactive = args[1];
    if (check_dict(active, "active") < 0 || check_dict(inactive, "inactive") < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[2], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (; i < n; i++) {
        int in = PyDict_Contains(active, items[i]);
        if (in == 0)
            in = PyDict_Contains(inactive, items[i]);
        if (in < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (!in)
            break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(i);
}

/* count_missing(active, hashes): hashes not in active. */
static PyObject *
count_missing(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "count_missing(active, hashes)");
        return NULL;
    }
    if (check_dict(args[0], "active") < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), missing = 0;
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int in = PyDict_Contains(args[0], items[i]);
        if (in < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        missing += !in;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(missing);
}

/* release_full(active, inactive, hashes): one reference less to each, tail first; a block at
 * refcount 0 leaves active for the inactive pool's most recent end. KeyError if not active. */
static PyObject *
release_full(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "release_full(active, inactive, hashes)");
        return NULL;
    }
    PyObject *active = args[0], *inactive = args[1];
    if (check_dict(active, "active") < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[2], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(seq) - 1; i >= 0; i--) {
        PyObject *h = items[i];
        PyObject *rc = PyDict_GetItemWithError(active, h); /* borrowed */
        if (rc == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, h);
            goto fail;
        }
        long count = PyLong_AsLong(rc);
        if (count == -1 && PyErr_Occurred())
            goto fail;
        if (count != 1) { /* as the fallback: any count but 1 is stored less one */
            PyObject *less = PyLong_FromLong(count - 1);
            if (less == NULL)
                goto fail;
            int r = PyDict_SetItem(active, h, less);
            Py_DECREF(less);
            if (r < 0)
                goto fail;
        } else {
            Py_INCREF(h); /* the key may die with its last reference in active */
            int r = PyDict_DelItem(active, h);
            if (r == 0)
                r = PyObject_SetItem(inactive, h, Py_None);
            Py_DECREF(h);
            if (r < 0)
                goto fail;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

/* evict(inactive, slots, locals, silent, free_slots, n): pop the n least recently used inactive
 * blocks, free their slots; the evicted hashes that were announced, in eviction order. */
static PyObject *
evict(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "evict(inactive, slots, locals, silent, free_slots, n)");
        return NULL;
    }
    PyObject *inactive = args[0], *slots = args[1], *locals = args[2], *silent = args[3],
             *free_slots = args[4];
    if (check_dict(slots, "slots") < 0 || check_dict(locals, "locals") < 0)
        return NULL;
    if (!PySet_Check(silent) || !PyList_Check(free_slots)) {
        PyErr_SetString(PyExc_TypeError, "silent must be a set and free_slots a list");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[5]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    PyObject *evicted = PyList_New(0);
    if (evicted == NULL)
        return NULL;
    PyObject *oldest = Py_False; /* popitem(last=False) */
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *pair = PyObject_CallMethodOneArg(inactive, s_popitem, oldest);
        if (pair == NULL)
            goto fail;
        PyObject *h = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
        Py_DECREF(pair);
        PyObject *slot = PyDict_GetItemWithError(slots, h); /* borrowed */
        int r = -1;
        if (slot == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, h);
        } else if (PyList_Append(free_slots, slot) == 0 && PyDict_DelItem(slots, h) == 0 &&
                   PyDict_DelItem(locals, h) == 0) {
            r = PySet_Discard(silent, h); /* 1: it was silent, never announced */
            if (r == 0)
                r = PyList_Append(evicted, h);
        }
        Py_DECREF(h);
        if (r < 0)
            goto fail;
    }
    return evicted;
fail:
    Py_DECREF(evicted);
    return NULL;
}


/* pin(active, inactive, hashes): one reference more to each active hash; an inactive one is
 * revived (leaves the pool, refcount 1); the indices of the others (absent), in order. */
static PyObject *
pin(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pin(active, inactive, hashes)");
        return NULL;
    }
    PyObject *active = args[0], *inactive = args[1];
    if (check_dict(active, "active") < 0 || check_dict(inactive, "inactive") < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[2], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *absent = PyList_New(0), *one = PyLong_FromLong(1);
    if (absent == NULL || one == NULL)
        goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = items[i];
        PyObject *rc = PyDict_GetItemWithError(active, h); /* borrowed */
        int r;
        if (rc != NULL) {
            PyObject *more = PyNumber_Add(rc, one);
            if (more == NULL)
                goto fail;
            r = PyDict_SetItem(active, h, more);
            Py_DECREF(more);
        } else if (PyErr_Occurred()) {
            goto fail;
        } else {
            r = PyDict_Contains(inactive, h);
            if (r == 1) {
                r = PyObject_DelItem(inactive, h);
                if (r == 0)
                    r = PyDict_SetItem(active, h, one);
            } else if (r == 0) {
                PyObject *index = PyLong_FromSsize_t(i);
                r = index == NULL ? -1 : PyList_Append(absent, index);
                Py_XDECREF(index);
            }
        }
        if (r < 0)
            goto fail;
    }
    Py_DECREF(seq);
    Py_DECREF(one);
    return absent;
fail:
    Py_DECREF(seq);
    Py_XDECREF(one);
    Py_XDECREF(absent);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"cached_prefix", (PyCFunction)(void (*)(void))cached_prefix, METH_FASTCALL,
     "cached_prefix(active, inactive, hashes): leading hashes cached."},
    {"count_missing", (PyCFunction)(void (*)(void))count_missing, METH_FASTCALL,
     "count_missing(active, hashes): hashes not active."},
    {"pin", (PyCFunction)(void (*)(void))pin, METH_FASTCALL,
     "pin(active, inactive, hashes): reference the present ones; the indices of the absent."},
    {"release_full", (PyCFunction)(void (*)(void))release_full, METH_FASTCALL,
     "release_full(active, inactive, hashes): drop one reference to each, tail first."},
    {"evict", (PyCFunction)(void (*)(void))evict, METH_FASTCALL,
     "evict(inactive, slots, locals, silent, free_slots, n): evict n LRU blocks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kv_module = {
    PyModuleDef_HEAD_INIT, "dynamo.engine_core._kv",
    "Native loops of the KV manager's accounting (see _kv.pyi).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__kv(void)
{
    if ((s_popitem = PyUnicode_InternFromString("popitem")) == NULL)
        return NULL;
    return PyModule_Create(&kv_module);
}

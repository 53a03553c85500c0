/*
 * dynamo.router._cost: the KV router's cost of every candidate and the argmin with random
 * tie-breaks (FACTS §4.2-§4.3), over columns of numbers.
 *
 * Why native: the router scores every (worker, dp_rank) on every request. As Python objects
 * (a Candidate per target, a cost loop, a tie loop) that was ~3 µs per candidate: with 100
 * workers, about a third of the offline replay's CPU (docs/performance.md, "Offline replay"),
 * and the same code routes live traffic. Here the loop is plain double arithmetic in the
 * fallback's order of operations, so the costs are bit-for-bit the Python ones, and the tie
 * loop draws from the caller's random.Random exactly when the Python loop does.
 *
 * The contract is ``_cost.pyi``; ``_cost_fallback.py`` is the same in Python (``dynamo.native``
 * picks one) and tests/unit/router/test_cost_native.py holds the two to the same outputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include "_cost.h" /* the formula and the tie draw, shared with _route.c */

/* Column i as doubles (ints converted as Python's int -> float does for |x| < 2**53). */
static int
column(PyObject *obj, Py_ssize_t n, double *out, const char *name)
{
    PyObject *seq = PySequence_Fast(obj, "columns must be sequences of ints");
    if (seq == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "every column must have one item per candidate");
        return -1;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        out[i] = (double)v;
    }
    Py_DECREF(seq);
    (void)name;
    return 0;
}

static PyObject *
costs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "costs(overlap, prefill, decode, new, requests, isl_tokens, block_size, "
                        "params)");
        return NULL;
    }
    long long isl, block_size;
    DynCostParams params;
    if (dyn_cost_args(args[5], args[6], args[7], &isl, &block_size, &params) < 0)
        return NULL;
    Py_ssize_t n = PyObject_Length(args[0]);
    if (n < 0)
        return NULL;
    double *buf = PyMem_Malloc(sizeof(double) * 6 * (size_t)(n > 0 ? n : 1));
    if (buf == NULL)
        return PyErr_NoMemory();
    double *overlap = buf, *prefill = buf + n, *decode = buf + 2 * n, *new_ = buf + 3 * n,
           *requests = buf + 4 * n, *cost = buf + 5 * n;
    PyObject *out = NULL;
    if (column(args[0], n, overlap, "overlap") < 0 || column(args[1], n, prefill, "prefill") < 0 ||
        column(args[2], n, decode, "decode") < 0 || column(args[3], n, new_, "new") < 0 ||
        column(args[4], n, requests, "requests") < 0)
        goto done;
    if ((out = PyList_New(n)) == NULL)
        goto done;
    dyn_costs(&params, n, overlap, prefill, decode, new_, requests, isl, block_size, cost);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyFloat_FromDouble(cost[i]);
        if (f == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, f);
    }
done:
    PyMem_Free(buf);
    return out;
}

static PyObject *
argmin_random_tie(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "argmin_random_tie(values, rng)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "values must be a sequence of floats");
    if (seq == NULL)
        return NULL;
    DynTie tie = {NULL, NULL, NULL};
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), chosen = 0, ties = 0;
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    double best = INFINITY;
    for (Py_ssize_t i = 0; i < n; i++) {
        double c = PyFloat_AsDouble(items[i]);
        if (c == -1.0 && PyErr_Occurred())
            goto fail;
        if (c < best) {
            best = c;
            chosen = i;
            ties = 1;
        } else if (c == best) {
            ties++;
            long draw = dyn_tie_draw(&tie, args[1], ties);
            if (draw < 0)
                goto fail;
            if (draw == 0)
                chosen = i;
        }
    }
    Py_DECREF(seq);
    dyn_tie_clear(&tie);
    return PyLong_FromSsize_t(chosen);
fail:
    Py_DECREF(seq);
    dyn_tie_clear(&tie);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"costs", (PyCFunction)(void (*)(void))costs, METH_FASTCALL,
     "costs(overlap, prefill, decode, new, requests, isl_tokens, block_size, params): the cost "
     "of each candidate."},
    {"argmin_random_tie", (PyCFunction)(void (*)(void))argmin_random_tie, METH_FASTCALL,
     "argmin_random_tie(values, rng): index of the minimum, ties broken uniformly."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cost_module = {
    PyModuleDef_HEAD_INIT, "dynamo.router._cost",
    "The KV router's candidate costs in C (see _cost.pyi).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__cost(void)
{
    if (dyn_cost_init() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&cost_module);
    if (m != NULL && PyModule_AddObjectRef(m, "STATE_DRAWS", dyn_mt_ok ? Py_True : Py_False) < 0)
        Py_CLEAR(m);
    return m;
}

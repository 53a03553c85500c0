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
    long long isl = PyLong_AsLongLong(args[5]);
    if (isl == -1 && PyErr_Occurred())
        return NULL;
    long long block_size = PyLong_AsLongLong(args[6]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0");
        return NULL;
    }
    double credit_w, scale, request_w, decay_w;
    int track_prefill;
    if (!PyArg_ParseTuple(args[7], "ddddp", &credit_w, &scale, &request_w, &decay_w,
                          &track_prefill))
        return NULL;
    Py_ssize_t n = PyObject_Length(args[0]);
    if (n < 0)
        return NULL;
    double *buf = PyMem_Malloc(sizeof(double) * 5 * (size_t)(n > 0 ? n : 1));
    if (buf == NULL)
        return PyErr_NoMemory();
    double *overlap = buf, *prefill = buf + n, *decode = buf + 2 * n, *new_ = buf + 3 * n,
           *requests = buf + 4 * n;
    PyObject *out = NULL;
    if (column(args[0], n, overlap, "overlap") < 0 || column(args[1], n, prefill, "prefill") < 0 ||
        column(args[2], n, decode, "decode") < 0 || column(args[3], n, new_, "new") < 0 ||
        column(args[4], n, requests, "requests") < 0)
        goto done;
    double b = (double)block_size;
    double request_blocks = (double)isl / b;
    if (request_blocks < 1.0)
        request_blocks = 1.0;
    int decay_on = decay_w > 0 && track_prefill;
    double min_prefill = 0.0;
    if (decay_on && n > 0) {
        min_prefill = prefill[0];
        for (Py_ssize_t i = 1; i < n; i++)
            if (prefill[i] < min_prefill)
                min_prefill = prefill[i];
    }
    if ((out = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        double decay = 1.0;
        if (decay_on) {
            /* (prefill - min) is an int subtraction in Python: exact here below 2**53 */
            double excess = (prefill[i] - min_prefill) / b;
            decay = 1.0 / (1.0 + decay_w * excess / request_blocks);
        }
        double credit = credit_w * decay * overlap[i];
        double load = request_w * requests[i];
        double potential = decode[i] + new_[i];
        double cost;
        if (track_prefill) {
            double p = (prefill[i] + (double)isl) / b - credit;
            cost = scale * (p > 0.0 ? p : 0.0) + potential + load;
        } else if (credit_w > 0) {
            double p = potential - credit;
            cost = (p > 0.0 ? p : 0.0) + load;
        } else {
            cost = potential + load;
        }
        PyObject *f = PyFloat_FromDouble(cost);
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

/* The tie loop's draws: rng.randrange(k) for the k-th tie. For a plain random.Random (its
 * type exactly, no instance attribute shadowing the methods involved) randrange(k) is
 * _randbelow_with_getrandbits(k): getrandbits(k.bit_length()) until a value below k; calling
 * the C getrandbits here makes the same calls on the generator, hence the same draws and the
 * same state after, without three Python frames per tie (with 100 idle workers tied, the
 * router's choice was ~50 µs of them). Any other rng: its randrange, as the fallback does. */
static PyObject *random_type; /* random.Random */

typedef struct {
    PyObject *getrandbits; /* the fast path's bound method, or NULL */
    PyObject *randrange;   /* otherwise */
} Tie;

static int
plain_random(PyObject *rng)
{
    if (random_type == NULL || (PyObject *)Py_TYPE(rng) != random_type)
        return 0;
    PyObject *dict = PyObject_GenericGetDict(rng, NULL);
    if (dict == NULL) {
        PyErr_Clear();
        return 0;
    }
    static const char *const shadowing[] = {"randrange", "_randbelow", "getrandbits"};
    int plain = 1;
    for (size_t k = 0; k < sizeof shadowing / sizeof *shadowing; k++) {
        PyObject *hit = PyDict_GetItemString(dict, shadowing[k]);
        if (hit != NULL)
            plain = 0;
    }
    Py_DECREF(dict);
    return plain;
}

static int
tie_init(Tie *tie, PyObject *rng)
{
    if (plain_random(rng))
        tie->getrandbits = PyObject_GetAttrString(rng, "getrandbits");
    else
        tie->randrange = PyObject_GetAttrString(rng, "randrange");
    return tie->getrandbits == NULL && tie->randrange == NULL ? -1 : 0;
}

/* A draw in [0, k) as rng.randrange(k) makes it; -1 with an exception set on failure. */
static long
tie_draw(Tie *tie, Py_ssize_t k)
{
    if (tie->getrandbits != NULL) {
        int bits = 0;
        for (unsigned long long v = (unsigned long long)k; v != 0; v >>= 1)
            bits++;
        PyObject *nbits = PyLong_FromLong(bits);
        if (nbits == NULL)
            return -1;
        unsigned long long r;
        do {
            PyObject *got = PyObject_CallOneArg(tie->getrandbits, nbits);
            if (got == NULL) {
                Py_DECREF(nbits);
                return -1;
            }
            r = PyLong_AsUnsignedLongLong(got);
            Py_DECREF(got);
            if (r == (unsigned long long)-1 && PyErr_Occurred()) {
                Py_DECREF(nbits);
                return -1;
            }
        } while (r >= (unsigned long long)k);
        Py_DECREF(nbits);
        return (long)r;
    }
    PyObject *arg = PyLong_FromSsize_t(k);
    if (arg == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(tie->randrange, arg);
    Py_DECREF(arg);
    if (r == NULL)
        return -1;
    long draw = PyLong_AsLong(r);
    Py_DECREF(r);
    if (draw == -1 && PyErr_Occurred())
        return -1;
    if (draw < 0 || draw >= k) {
        PyErr_SetString(PyExc_ValueError, "rng.randrange(k) returned a value outside [0, k)");
        return -1;
    }
    return draw;
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
    Tie tie = {NULL, NULL};
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
            if (tie.getrandbits == NULL && tie.randrange == NULL && tie_init(&tie, args[1]) < 0)
                goto fail;
            long draw = tie_draw(&tie, ties);
            if (draw < 0)
                goto fail;
            if (draw == 0)
                chosen = i;
        }
    }
    Py_DECREF(seq);
    Py_XDECREF(tie.getrandbits);
    Py_XDECREF(tie.randrange);
    return PyLong_FromSsize_t(chosen);
fail:
    Py_DECREF(seq);
    Py_XDECREF(tie.getrandbits);
    Py_XDECREF(tie.randrange);
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
    PyObject *random = PyImport_ImportModule("random");
    if (random == NULL)
        return NULL;
    random_type = PyObject_GetAttrString(random, "Random");
    Py_DECREF(random);
    if (random_type == NULL)
        return NULL;
    return PyModule_Create(&cost_module);
}

/*
 * dynamo/router/_cost.h: the KV router's cost of one candidate and the tie-break draw (FACTS
 * §4.2-§4.3), shared by the cost kernel (``_cost.c``: costs of columns of Python ints) and the
 * route kernel (``_route.c``: the loads read from the ranks), so both compute one formula.
 *
 * The arithmetic is the fallback's (``_cost_fallback.py``) in its order of operations, so the
 * costs are bit-for-bit the Python ones; the tie loop draws from the caller's random.Random
 * exactly when the Python loop does.
 */
#ifndef DYNAMO_ROUTER_COST_H
#define DYNAMO_ROUTER_COST_H

#include <Python.h>
#include <math.h>

/* The kernel's ``params`` tuple: (credit, prefill scale, request weight, decay, track prefill). */
typedef struct {
    double credit_w, scale, request_w, decay_w;
    int track_prefill;
} DynCostParams;

/* Parse ``params``: 0, or -1 with an exception. */
static int
dyn_cost_params(PyObject *params, DynCostParams *p)
{
    return PyArg_ParseTuple(params, "ddddp", &p->credit_w, &p->scale, &p->request_w, &p->decay_w,
                            &p->track_prefill)
               ? 0
               : -1;
}

/* The kernel's scalar arguments ``isl_tokens``, ``block_size`` (> 0) and ``params``, as both
 * ``_cost.costs`` and ``_route.choose`` take them: 0, or -1 with an exception. */
static int
dyn_cost_args(PyObject *isl_obj, PyObject *block_size_obj, PyObject *params, long long *isl,
              long long *block_size, DynCostParams *p)
{
    *isl = PyLong_AsLongLong(isl_obj);
    if (*isl == -1 && PyErr_Occurred())
        return -1;
    *block_size = PyLong_AsLongLong(block_size_obj);
    if (*block_size == -1 && PyErr_Occurred())
        return -1;
    if (*block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0");
        return -1;
    }
    return dyn_cost_params(params, p);
}

/* The cost of each of ``n`` candidates into ``out`` (columns of doubles holding ints). */
static void
dyn_costs(const DynCostParams *p, Py_ssize_t n, const double *overlap, const double *prefill,
          const double *decode, const double *new_, const double *requests, long long isl,
          long long block_size, double *out)
{
    double b = (double)block_size;
    double request_blocks = (double)isl / b;
    if (request_blocks < 1.0)
        request_blocks = 1.0;
    int decay_on = p->decay_w > 0 && p->track_prefill;
    double min_prefill = 0.0;
    if (decay_on && n > 0) {
        min_prefill = prefill[0];
        for (Py_ssize_t i = 1; i < n; i++)
            if (prefill[i] < min_prefill)
                min_prefill = prefill[i];
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double decay = 1.0;
        if (decay_on) {
            /* (prefill - min) is an int subtraction in Python: exact here below 2**53 */
            double excess = (prefill[i] - min_prefill) / b;
            decay = 1.0 / (1.0 + p->decay_w * excess / request_blocks);
        }
        double credit = p->credit_w * decay * overlap[i];
        double load = p->request_w * requests[i];
        double potential = decode[i] + new_[i];
        double cost;
        if (p->track_prefill) {
            double q = (prefill[i] + (double)isl) / b - credit;
            cost = p->scale * (q > 0.0 ? q : 0.0) + potential + load;
        } else if (p->credit_w > 0) {
            double q = potential - credit;
            cost = (q > 0.0 ? q : 0.0) + load;
        } else {
            cost = potential + load;
        }
        out[i] = cost;
    }
}

/* The tie loop's draws: rng.randrange(k) for the k-th tie. For a plain random.Random (its
 * type exactly, no instance attribute shadowing the methods involved) randrange(k) is
 * _randbelow_with_getrandbits(k): getrandbits(k.bit_length()) until a value below k; calling
 * the C getrandbits here makes the same calls on the generator, hence the same draws and the
 * same state after, without three Python frames per tie (with 100 idle workers tied, the
 * router's choice was ~50 µs of them). Any other rng: its randrange, as the fallback does. */
static PyObject *dyn_random_type; /* random.Random, set by dyn_cost_init */

/* At module init: 0, or -1 with an exception. */
static int
dyn_cost_init(void)
{
    PyObject *random = PyImport_ImportModule("random");
    if (random == NULL)
        return -1;
    dyn_random_type = PyObject_GetAttrString(random, "Random");
    Py_DECREF(random);
    return dyn_random_type == NULL ? -1 : 0;
}

typedef struct {
    PyObject *getrandbits; /* the fast path's bound method, or NULL */
    PyObject *randrange;   /* otherwise */
} DynTie;

static int
dyn_plain_random(PyObject *rng)
{
    if (dyn_random_type == NULL || (PyObject *)Py_TYPE(rng) != dyn_random_type)
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
dyn_tie_init(DynTie *tie, PyObject *rng)
{
    if (dyn_plain_random(rng))
        tie->getrandbits = PyObject_GetAttrString(rng, "getrandbits");
    else
        tie->randrange = PyObject_GetAttrString(rng, "randrange");
    return tie->getrandbits == NULL && tie->randrange == NULL ? -1 : 0;
}

static void
dyn_tie_clear(DynTie *tie)
{
    Py_CLEAR(tie->getrandbits);
    Py_CLEAR(tie->randrange);
}

/* A draw in [0, k) as rng.randrange(k) makes it (the tie initialised on first use); -1 with an
 * exception set on failure. */
static long
dyn_tie_draw(DynTie *tie, PyObject *rng, Py_ssize_t k)
{
    if (tie->getrandbits == NULL && tie->randrange == NULL && dyn_tie_init(tie, rng) < 0)
        return -1;
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

#endif

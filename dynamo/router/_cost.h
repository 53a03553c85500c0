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
#include <stdint.h>

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
 * _randbelow_with_getrandbits(k): getrandbits(k.bit_length()) until a value below k. Here the
 * same words are taken from the generator's Mersenne Twister state itself (``DynMT``: the
 * layout of CPython's ``_random.Random``, checked at import against the generator's own
 * getrandbits: see ``dyn_mt_check``), hence the same draws and the same state after, without a
 * call a tie (with 100 idle workers tied, ~44 getrandbits calls a request); where the check
 * fails, through the C getrandbits method; any other rng: its randrange, as the fallback does. */
static PyObject *dyn_random_type; /* random.Random, set by dyn_cost_init */
static PyObject *dyn_shadowing[3]; /* the instance attributes that would shadow the fast path */
static int dyn_mt_ok;              /* 1: a plain random.Random's state is read as DynMT */

/* CPython's ``_random.Random`` object (Modules/_randommodule.c, 3.x): MT19937's state. */
#define DYN_MT_N 624
#define DYN_MT_M 397
typedef struct {
    PyObject_HEAD
    int index;
    uint32_t state[DYN_MT_N];
} DynMT;

/* The generator's next 32-bit word: genrand_uint32 of _randommodule.c, step for step. */
static uint32_t
dyn_mt_next(DynMT *r)
{
    static const uint32_t mag01[2] = {0x0U, 0x9908b0dfU};
    uint32_t y, *mt = r->state;
    if (r->index >= DYN_MT_N) {
        int kk;
        for (kk = 0; kk < DYN_MT_N - DYN_MT_M; kk++) {
            y = (mt[kk] & 0x80000000U) | (mt[kk + 1] & 0x7fffffffU);
            mt[kk] = mt[kk + DYN_MT_M] ^ (y >> 1) ^ mag01[y & 0x1U];
        }
        for (; kk < DYN_MT_N - 1; kk++) {
            y = (mt[kk] & 0x80000000U) | (mt[kk + 1] & 0x7fffffffU);
            mt[kk] = mt[kk + (DYN_MT_M - DYN_MT_N)] ^ (y >> 1) ^ mag01[y & 0x1U];
        }
        y = (mt[DYN_MT_N - 1] & 0x80000000U) | (mt[0] & 0x7fffffffU);
        mt[DYN_MT_N - 1] = mt[DYN_MT_M - 1] ^ (y >> 1) ^ mag01[y & 0x1U];
        r->index = 0;
    }
    y = mt[r->index++];
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= (y >> 18);
    return y;
}

/* Whether DynMT is random.Random's layout: the base's size, then 1,500 draws of 2 to 8 bits
 * (past two regenerations of the state) from one generator through DynMT and from a twin
 * seeded alike through its getrandbits, and the two states compared after. 1 or 0; -1 with
 * an exception only when the check itself could not run (no memory). */
static int
dyn_mt_check(void)
{
    PyTypeObject *t = (PyTypeObject *)dyn_random_type;
    if (t->tp_base == NULL || t->tp_base->tp_basicsize != (Py_ssize_t)sizeof(DynMT))
        return 0;
    PyObject *a = PyObject_CallFunction(dyn_random_type, "i", 20261126);
    PyObject *b = PyObject_CallFunction(dyn_random_type, "i", 20261126);
    PyObject *sa = NULL, *sb = NULL;
    int ok = a != NULL && b != NULL;
    for (int i = 0; ok && i < 1500; i++) {
        int nbits = 2 + i % 7;
        uint32_t mine = dyn_mt_next((DynMT *)a) >> (32 - nbits);
        PyObject *got = PyObject_CallMethod(b, "getrandbits", "i", nbits);
        if (got == NULL)
            break;
        unsigned long theirs = PyLong_AsUnsignedLong(got);
        Py_DECREF(got);
        ok = theirs == mine;
    }
    if (ok && !PyErr_Occurred() && (sa = PyObject_CallMethod(a, "getstate", NULL)) != NULL &&
        (sb = PyObject_CallMethod(b, "getstate", NULL)) != NULL)
        ok = PyObject_RichCompareBool(sa, sb, Py_EQ);
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(sa);
    Py_XDECREF(sb);
    if (PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError))
            return -1;
        PyErr_Clear(); /* anything else: the layout is not the one assumed */
        return 0;
    }
    return ok == 1;
}

/* At module init: 0, or -1 with an exception. */
static int
dyn_cost_init(void)
{
    PyObject *random = PyImport_ImportModule("random");
    if (random == NULL)
        return -1;
    dyn_random_type = PyObject_GetAttrString(random, "Random");
    Py_DECREF(random);
    if (dyn_random_type == NULL)
        return -1;
    if (!PyType_Check(dyn_random_type)) {
        PyErr_SetString(PyExc_TypeError, "random.Random is not a class");
        return -1;
    }
    static const char *const shadowing[] = {"randrange", "_randbelow", "getrandbits"};
    for (int k = 0; k < 3; k++)
        if ((dyn_shadowing[k] = PyUnicode_InternFromString(shadowing[k])) == NULL)
            return -1;
    int ok = dyn_mt_check();
    if (ok < 0)
        return -1;
    dyn_mt_ok = ok;
    return 0;
}

typedef struct {
    PyObject *getrandbits; /* the method's path: its bound method, or NULL */
    PyObject *randrange;   /* any other rng */
    DynMT *mt;             /* the state's path: the rng (borrowed: the caller holds it) */
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
    int plain = 1;
    for (size_t k = 0; k < 3; k++) {
        PyObject *hit = PyDict_GetItemWithError(dict, dyn_shadowing[k]);
        if (hit != NULL || PyErr_Occurred())
            plain = 0;
    }
    PyErr_Clear();
    Py_DECREF(dict);
    return plain;
}

static int
dyn_tie_init(DynTie *tie, PyObject *rng)
{
    if (dyn_plain_random(rng)) {
        if (dyn_mt_ok) {
            tie->mt = (DynMT *)rng;
            return 0;
        }
        tie->getrandbits = PyObject_GetAttrString(rng, "getrandbits");
    } else
        tie->randrange = PyObject_GetAttrString(rng, "randrange");
    return tie->getrandbits == NULL && tie->randrange == NULL ? -1 : 0;
}

static void
dyn_tie_clear(DynTie *tie)
{
    Py_CLEAR(tie->getrandbits);
    Py_CLEAR(tie->randrange);
    tie->mt = NULL;
}

/* A draw in [0, k) as rng.randrange(k) makes it (the tie initialised on first use); -1 with an
 * exception set on failure. */
static long
dyn_tie_draw(DynTie *tie, PyObject *rng, Py_ssize_t k)
{
    if (tie->getrandbits == NULL && tie->randrange == NULL && tie->mt == NULL &&
        dyn_tie_init(tie, rng) < 0)
        return -1;
    int bits = 0;
    for (unsigned long long v = (unsigned long long)k; v != 0; v >>= 1)
        bits++;
    if (tie->mt != NULL && bits <= 32) { /* getrandbits(bits) for bits <= 32: one word */
        uint32_t r;
        do
            r = dyn_mt_next(tie->mt) >> (32 - bits);
        while ((unsigned long long)r >= (unsigned long long)k);
        return (long)r;
    }
    if (tie->mt != NULL && tie->getrandbits == NULL &&
        (tie->getrandbits = PyObject_GetAttrString(rng, "getrandbits")) == NULL)
        return -1; /* more than 2**32 ties: the method's path */
    if (tie->getrandbits != NULL) {
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

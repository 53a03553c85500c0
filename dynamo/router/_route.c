/*
 * dynamo.router._route: the KV router's choice among all of its targets in one call: the
 * overlap column from the prefix index's matches, the load columns read from the ranks' load
 * holders, the cost of each target and the argmin with its seeded tie-break draws (FACTS
 * §4.2-§4.3). ``RoutingCore`` (router/core.py) calls it for the common request (every target
 * eligible, no busy thresholds, temperature 0): the live KV router and the offline replay alike.
 *
 * Why native: the same steps in Python (``_route_fallback.py``, and before it
 * ``RoutingCore._select``: the index's matches re-keyed by worker, the kept load columns
 * refreshed and copied, the overlap column, the cost kernel, the tie loop, each a Python call)
 * were ~7 % of the offline replay's CPU, most of it the glue between C kernels.
 *
 * The loads are read from the ranks' slotted fields at their offsets (``dynamo/_slots.h``);
 * the cost formula and the tie draw are ``_cost.h``'s, shared with ``_cost.c``, so the costs
 * are bit-for-bit the Python ones and the generator makes the same draws.
 *
 * The contract is ``_route.pyi``; ``_route_fallback.py`` is the same in Python (``dynamo.native``
 * picks one) and tests/unit/router/test_route_native.py holds the two to the same outputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "../_slots.h"
#include "../_u64.h"
#include "_cost.h"

/* The fields of a rank's load holder (``router.sequences._Rank``) it reads. */
static const char *const rank_fields[] = {"prefill_tokens", "private_blocks", "num_requests",
                                          "blocks"};
enum { F_PREFILL, F_PRIVATE, F_REQUESTS, F_BLOCKS };
#define SMALL_TARGETS 128 /* up to this many targets, the columns live on the stack */
static DynSlots rank_slots = DYN_SLOTS_OF(rank_fields);

/* An int as a long long: 0, or -1 with an exception (a non-negative exact int of at most
 * three digits read from its digits, ``dynamo/_u64.h``; anything else through the API). */
static inline int
as_ll(PyObject *v, long long *out)
{
    uint64_t u;
    if (dyn_u64_digits(v, &u) && u <= (uint64_t)LLONG_MAX) {
        *out = (long long)u;
        return 0;
    }
    *out = PyLong_AsLongLong(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* ``obj.<field f>`` as a long long: 0, or -1 with an exception. */
static int
read_int(PyObject *obj, int f, long long *out)
{
    if (Py_TYPE(obj) == rank_slots.type) { /* the learned class: the slot's value, borrowed */
        PyObject *v = *(PyObject **)((char *)obj + rank_slots.offsets[f]);
        if (v == NULL) {
            PyErr_Format(PyExc_AttributeError, "%U", rank_slots.names[f]);
            return -1;
        }
        return as_ll(v, out);
    }
    PyObject *v = dyn_slots_get(&rank_slots, obj, f);
    if (v == NULL)
        return -1;
    int rc = as_ll(v, out);
    Py_DECREF(v);
    return rc;
}

/* One rank's load into the columns at ``i``: 0, or -1 with an exception. A rank of the learned
 * class has its four slots read in place (one type test, no references taken: with 100
 * targets, four hundred reads a request); any other through ``read_int``'s attribute path. */
static int
read_rank(PyObject *rank, Py_ssize_t i, int track_blocks, double *prefill, double *decode,
          double *requests)
{
    long long tokens, private, count;
    if (Py_TYPE(rank) == rank_slots.type) {
        char *at = (char *)rank;
        const Py_ssize_t *off = rank_slots.offsets;
        PyObject *t = *(PyObject **)(at + off[F_PREFILL]);
        PyObject *c = *(PyObject **)(at + off[F_REQUESTS]);
        PyObject *p = *(PyObject **)(at + off[F_PRIVATE]);
        PyObject *b = *(PyObject **)(at + off[F_BLOCKS]);
        if (t != NULL && c != NULL && p != NULL && b != NULL) {
            if (as_ll(t, &tokens) < 0 || as_ll(c, &count) < 0)
                return -1;
            prefill[i] = (double)tokens;
            requests[i] = (double)count;
            decode[i] = 0.0;
            if (track_blocks) {
                if (as_ll(p, &private) < 0)
                    return -1;
                Py_INCREF(b); /* its __len__ could replace the slot */
                Py_ssize_t held = PyObject_Length(b);
                Py_DECREF(b);
                if (held < 0)
                    return -1;
                decode[i] = (double)((long long)held + private);
            }
            return 0;
        } /* an unset slot: the attribute path raises its AttributeError */
    }
    if (read_int(rank, F_PREFILL, &tokens) < 0 || read_int(rank, F_REQUESTS, &count) < 0)
        return -1;
    prefill[i] = (double)tokens;
    requests[i] = (double)count;
    decode[i] = 0.0;
    if (track_blocks) {
        if (read_int(rank, F_PRIVATE, &private) < 0)
            return -1;
        PyObject *blocks = dyn_slots_get(&rank_slots, rank, F_BLOCKS);
        if (blocks == NULL)
            return -1;
        Py_ssize_t held = PyObject_Length(blocks);
        Py_DECREF(blocks);
        if (held < 0)
            return -1;
        decode[i] = (double)((long long)held + private);
    }
    return 0;
}

/* The overlap column from ``matches``: 0, or -1 with an exception. */
static int
fill_overlap(PyObject *matches, PyObject *key_of, PyObject *place_of, Py_ssize_t n,
             double *overlap)
{
    Py_ssize_t pos = 0;
    PyObject *match, *blocks;
    while (PyDict_Next(matches, &pos, &match, &blocks)) {
        PyObject *key = match;
        if (key_of != Py_None) { /* a slot of the index: its key */
            Py_ssize_t slot = PyLong_AsSsize_t(match);
            if (slot == -1 && PyErr_Occurred())
                return -1;
            if (slot < 0 || slot >= PyList_GET_SIZE(key_of)) {
                PyErr_SetString(PyExc_IndexError, "a matched slot has no key");
                return -1;
            }
            key = PyList_GET_ITEM(key_of, slot);
        }
        PyObject *place = PyDict_GetItemWithError(place_of, key);
        if (place == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue; /* not a target */
        }
        Py_ssize_t i = PyLong_AsSsize_t(place);
        if (i == -1 && PyErr_Occurred())
            return -1;
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_IndexError, "a target's place is outside the ranks");
            return -1;
        }
        long long v;
        if (as_ll(blocks, &v) < 0)
            return -1;
        overlap[i] = (double)v;
    }
    return 0;
}

static PyObject *
choose(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "choose(matches, key_of, place_of, ranks, new, isl_tokens, block_size, "
                        "params, rng, track_blocks)");
        return NULL;
    }
    PyObject *matches = args[0], *key_of = args[1], *place_of = args[2], *ranks = args[3],
             *new_col = args[4], *rng = args[8];
    if (!PyDict_Check(matches) || !PyDict_Check(place_of) || !PyList_Check(new_col) ||
        (key_of != Py_None && !PyList_Check(key_of))) {
        PyErr_SetString(PyExc_TypeError, "choose() takes dict matches, a list or None key_of, "
                                         "a dict place_of and a list new");
        return NULL;
    }
    long long isl, block_size;
    DynCostParams params;
    if (dyn_cost_args(args[5], args[6], args[7], &isl, &block_size, &params) < 0)
        return NULL;
    int track_blocks = PyObject_IsTrue(args[9]);
    if (track_blocks < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(ranks, "ranks must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0 || PyList_GET_SIZE(new_col) != n) {
        PyErr_SetString(PyExc_ValueError, n == 0 ? "choose() needs at least one target"
                                                 : "new must have one item per rank");
        Py_DECREF(seq);
        return NULL;
    }
    double small[6 * SMALL_TARGETS];
    double *buf = n <= SMALL_TARGETS ? small : PyMem_Malloc(6 * (size_t)n * sizeof(double));
    if (buf == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    double *overlap = buf, *prefill = buf + n, *decode = buf + 2 * n, *new_ = buf + 3 * n,
           *requests = buf + 4 * n, *cost = buf + 5 * n;
    PyObject *costs = NULL, *out = NULL;
    DynTie tie = {NULL, NULL, NULL};
    memset(overlap, 0, (size_t)n * sizeof(double)); /* a target without a match: 0 */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rank = PySequence_Fast_GET_ITEM(seq, i);
        if (read_rank(rank, i, track_blocks, prefill, decode, requests) < 0)
            goto done;
        new_[i] = 0.0;
        if (track_blocks) {
            long long v;
            if (as_ll(PyList_GET_ITEM(new_col, i), &v) < 0)
                goto done;
            new_[i] = (double)v;
        }
    }
    if (fill_overlap(matches, key_of, place_of, n, overlap) < 0)
        goto done;
    dyn_costs(&params, n, overlap, prefill, decode, new_, requests, isl, block_size, cost);
    Py_ssize_t chosen = 0, ties = 0;
    double best = INFINITY;
    for (Py_ssize_t i = 0; i < n; i++) { /* argmin_random_tie's loop over the same doubles */
        if (cost[i] < best) {
            best = cost[i];
            chosen = i;
            ties = 1;
        } else if (cost[i] == best) {
            ties++;
            long draw = dyn_tie_draw(&tie, rng, ties);
            if (draw < 0)
                goto done;
            if (draw == 0)
                chosen = i;
        }
    }
    if ((costs = PyList_New(n)) == NULL)
        goto done;
    /* Equal costs share one float (floats are immutable): the targets without the prefix and
     * without load (most of 100 workers) cost the same, so their ~70 floats a request were
     * as many allocations and frees. The last few distinct values are remembered by their bits
     * (-0.0 and 0.0 stay apart). */
    enum { RECENT = 4 };
    PyObject *recent[RECENT] = {NULL};
    uint64_t recent_bits[RECENT] = {0};
    int next = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t bits;
        memcpy(&bits, &cost[i], sizeof bits);
        PyObject *f = NULL;
        for (int r = 0; r < RECENT; r++)
            if (recent[r] != NULL && recent_bits[r] == bits) {
                f = Py_NewRef(recent[r]);
                break;
            }
        if (f == NULL) {
            if ((f = PyFloat_FromDouble(cost[i])) == NULL)
                goto done; /* the list holds every float made so far */
            recent[next] = f; /* borrowed: the list holds it */
            recent_bits[next] = bits;
            next = (next + 1) % RECENT;
        }
        PyList_SET_ITEM(costs, i, f);
    }
    out = Py_BuildValue("nLO", chosen, (long long)overlap[chosen], costs);
done:
    Py_DECREF(seq);
    Py_XDECREF(costs);
    dyn_tie_clear(&tie);
    if (buf != small)
        PyMem_Free(buf);
    return out;
}

static PyMethodDef module_methods[] = {
    {"choose", (PyCFunction)(void (*)(void))choose, METH_FASTCALL,
     "choose(matches, key_of, place_of, ranks, new, isl_tokens, block_size, params, rng, "
     "track_blocks): (place, overlap blocks, costs) of the chosen target."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef route_module = {
    PyModuleDef_HEAD_INIT, "dynamo.router._route",
    "The KV router's choice among its targets in C (see _route.pyi).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__route(void)
{
    if (dyn_cost_init() < 0 || dyn_slots_init(&rank_slots) < 0)
        return NULL;
    return PyModule_Create(&route_module);
}

/*
 * dynamo.router._active: a request's load into and out of ``ActiveSequences``
 * (router/sequences.py): ``add_routed`` (the router's record on a known rank),
 * ``mark_prefill_completed`` and ``free``, each one call on the tracker's and its ranks' slots.
 *
 * Why native: these three run once each per routed request (the KV router, live and in the
 * offline replay, and the slot tracker); in Python each was a frame of ~30 attribute reads and
 * writes around one C call (the rank's block table). ``RoutingCore`` and the route recorder
 * (``_route_record.c``) call them directly, without the methods' frames.
 *
 * The tracker (``ActiveSequences``, ``__slots__``), its ranks (``_Rank``, a slotted dataclass)
 * and requests (``_Request``, a msgspec Struct) are read and written at their slot offsets
 * (``dynamo/_slots.h``; another class goes through getattr / setattr). Ints are added with the
 * number protocol: the same values as Python's for any int.
 *
 * The contract is ``_active.pyi``; ``_active_fallback.py`` is the same in Python (``dynamo.native``
 * picks one) and tests/unit/router/test_active_native.py holds the two to the same states.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../_slots.h"

static const char *const seq_fields[] = {"_requests",   "_clock",          "_next_check",
                                         "_block_size", "_assume_kv_reuse", "_stale"};
enum { S_REQUESTS, S_CLOCK, S_NEXT, S_BS, S_REUSE, S_STALE };
static DynSlots seq_slots = DYN_SLOTS_OF(seq_fields);

static const char *const rank_fields[] = {"blocks", "private_blocks", "prefill_tokens",
                                          "num_requests", "column"};
enum { R_BLOCKS, R_PRIVATE, R_PREFILL, R_REQUESTS, R_COLUMN };
static DynSlots rank_slots = DYN_SLOTS_OF(rank_fields);

static const char *const req_fields[] = {"rank", "keys", "private_blocks", "prefill_tokens"};
enum { Q_RANK, Q_KEYS, Q_PRIVATE, Q_PREFILL };
static DynSlots req_slots = DYN_SLOTS_OF(req_fields);

static PyObject *str_expire_stale, *str_add_prefix_keys, *str_remove_prefix_keys;
static PyObject *request_type;     /* dynamo.router.sequences._Request, on first use */
static PyObject *prefix_key_bytes; /* dynamo.router.block_counts.prefix_key_bytes, on first use */

static PyObject *
imported(PyObject **cache, const char *module, const char *name)
{
    if (*cache == NULL) {
        PyObject *m = PyImport_ImportModule(module);
        if (m == NULL)
            return NULL;
        *cache = PyObject_GetAttrString(m, name);
        Py_DECREF(m);
    }
    return *cache;
}

/* obj.<field f> op= delta (op: PyNumber_Add or PyNumber_Subtract): 0, or -1 with an exception. */
static int
update(DynSlots *l, PyObject *obj, int f, binaryfunc op, PyObject *delta)
{
    PyObject *v = dyn_slots_get(l, obj, f);
    if (v == NULL)
        return -1;
    PyObject *w = op(v, delta);
    Py_DECREF(v);
    if (w == NULL)
        return -1;
    int rc = dyn_slots_put(l, obj, f, w);
    Py_DECREF(w);
    return rc;
}

/* stale[rank.column] = rank */
static int
mark_stale(PyObject *seqs, PyObject *rank)
{
    PyObject *stale = dyn_slots_get(&seq_slots, seqs, S_STALE);
    if (stale == NULL)
        return -1;
    PyObject *column = dyn_slots_get(&rank_slots, rank, R_COLUMN);
    int rc = column == NULL ? -1 : PyObject_SetItem(stale, column, rank);
    Py_XDECREF(column);
    Py_DECREF(stale);
    return rc;
}

static PyObject *
add_routed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "add_routed(seqs, request_id, rank, sequence_hashes, "
                                         "new_isl_tokens, overlap_blocks, prefix_keys)");
        return NULL;
    }
    PyObject *seqs = args[0], *request_id = args[1], *rank = args[2], *hashes = args[3];
    PyObject *isl = args[4], *overlap = args[5], *prefix_keys = args[6];
    PyObject *requests = NULL, *now = NULL, *next = NULL, *bs = NULL, *prefill = NULL;
    PyObject *keys = NULL, *private = NULL, *req = NULL, *out = NULL, *t = NULL;
    if ((requests = dyn_slots_get(&seq_slots, seqs, S_REQUESTS)) == NULL)
        return NULL;
    int known = PySequence_Contains(requests, request_id);
    if (known) {
        Py_DECREF(requests);
        return known < 0 ? NULL : Py_NewRef(Py_False);
    }
    PyObject *clock = dyn_slots_get(&seq_slots, seqs, S_CLOCK);
    if (clock == NULL)
        goto done;
    now = PyObject_CallNoArgs(clock);
    Py_DECREF(clock);
    if (now == NULL || (next = dyn_slots_get(&seq_slots, seqs, S_NEXT)) == NULL)
        goto done;
    int due = PyObject_RichCompareBool(now, next, Py_GE);
    if (due < 0)
        goto done;
    if (due) {
        PyObject *call[2] = {seqs, now};
        PyObject *r = PyObject_VectorcallMethod(str_expire_stale, call,
                                                2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    if ((bs = dyn_slots_get(&seq_slots, seqs, S_BS)) == NULL)
        goto done;
    if ((t = PyNumber_Multiply(overlap, bs)) == NULL ||
        (prefill = PyNumber_Subtract(isl, t)) == NULL)
        goto done;
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL)
        goto done;
    int negative = PyObject_RichCompareBool(prefill, zero, Py_LT);
    if (negative > 0)
        Py_SETREF(prefill, Py_NewRef(zero));
    Py_DECREF(zero);
    if (negative < 0)
        goto done;
    PyObject *reuse_obj = dyn_slots_get(&seq_slots, seqs, S_REUSE);
    if (reuse_obj == NULL)
        goto done;
    int reuse = PyObject_IsTrue(reuse_obj);
    Py_DECREF(reuse_obj);
    if (reuse < 0)
        goto done;
    if (reuse) {
        if (prefix_keys != Py_None) {
            keys = Py_NewRef(prefix_keys);
        } else {
            PyObject *fn = imported(&prefix_key_bytes, "dynamo.router.block_counts",
                                    "prefix_key_bytes");
            if (fn == NULL || (keys = PyObject_CallOneArg(fn, hashes)) == NULL)
                goto done;
        }
        PyObject *blocks = dyn_slots_get(&rank_slots, rank, R_BLOCKS);
        if (blocks == NULL)
            goto done;
        PyObject *call[2] = {blocks, keys};
        PyObject *r = PyObject_VectorcallMethod(str_add_prefix_keys, call,
                                                2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(blocks);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
        if ((private = PyLong_FromLong(0)) == NULL)
            goto done;
    } else {
        if ((keys = PyBytes_FromStringAndSize(NULL, 0)) == NULL)
            goto done;
        Py_ssize_t n = PyObject_Length(hashes);
        if (n < 0 || (private = PyLong_FromSsize_t(n)) == NULL)
            goto done;
        if (update(&rank_slots, rank, R_PRIVATE, PyNumber_Add, private) < 0)
            goto done;
    }
    if (update(&rank_slots, rank, R_PREFILL, PyNumber_Add, prefill) < 0)
        goto done;
    PyObject *one = PyLong_FromLong(1);
    int rc = one == NULL ? -1 : update(&rank_slots, rank, R_REQUESTS, PyNumber_Add, one);
    Py_XDECREF(one);
    if (rc < 0 || mark_stale(seqs, rank) < 0)
        goto done;
    PyObject *type = imported(&request_type, "dynamo.router.sequences", "_Request");
    if (type == NULL)
        goto done;
    PyObject *fields[5] = {rank, keys, private, prefill, now};
    if ((req = PyObject_Vectorcall(type, fields, 5, NULL)) == NULL)
        goto done;
    if (PyObject_SetItem(requests, request_id, req) < 0)
        goto done;
    out = Py_NewRef(Py_True);
done:
    Py_XDECREF(requests);
    Py_XDECREF(now);
    Py_XDECREF(next);
    Py_XDECREF(bs);
    Py_XDECREF(t);
    Py_XDECREF(prefill);
    Py_XDECREF(keys);
    Py_XDECREF(private);
    Py_XDECREF(req);
    return out;
}

/* seqs._requests.get(request_id) (a new reference), or NULL: with an exception, or none (*found 0) */
static PyObject *
request_of(PyObject *seqs, PyObject *request_id, PyObject **requests)
{
    if ((*requests = dyn_slots_get(&seq_slots, seqs, S_REQUESTS)) == NULL)
        return NULL;
    if (PyDict_CheckExact(*requests)) {
        PyObject *req = PyDict_GetItemWithError(*requests, request_id);
        return Py_XNewRef(req);
    }
    PyObject *req = PyObject_GetItem(*requests, request_id);
    if (req == NULL && PyErr_ExceptionMatches(PyExc_KeyError))
        PyErr_Clear();
    return req;
}

static PyObject *
mark_prefill_completed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mark_prefill_completed(seqs, request_id)");
        return NULL;
    }
    PyObject *requests, *out = NULL, *tokens = NULL, *rank = NULL;
    PyObject *req = request_of(args[0], args[1], &requests);
    if (req == NULL) {
        Py_XDECREF(requests);
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    }
    if ((tokens = dyn_slots_get(&req_slots, req, Q_PREFILL)) == NULL)
        goto done;
    int pending = PyObject_IsTrue(tokens);
    if (pending < 0)
        goto done;
    if (pending) {
        if ((rank = dyn_slots_get(&req_slots, req, Q_RANK)) == NULL)
            goto done;
        if (update(&rank_slots, rank, R_PREFILL, PyNumber_Subtract, tokens) < 0)
            goto done;
        PyObject *zero = PyLong_FromLong(0);
        int rc = zero == NULL ? -1 : dyn_slots_put(&req_slots, req, Q_PREFILL, zero);
        Py_XDECREF(zero);
        if (rc < 0 || mark_stale(args[0], rank) < 0)
            goto done;
    }
    out = Py_NewRef(Py_True);
done:
    Py_DECREF(requests);
    Py_DECREF(req);
    Py_XDECREF(tokens);
    Py_XDECREF(rank);
    return out;
}

static PyObject *
free_request(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "free(seqs, request_id)");
        return NULL;
    }
    PyObject *seqs = args[0], *requests, *out = NULL, *rank = NULL, *v = NULL, *keys = NULL;
    PyObject *req = request_of(seqs, args[1], &requests);
    if (req == NULL) {
        Py_XDECREF(requests);
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    }
    if (PyObject_DelItem(requests, args[1]) < 0) /* the pop */
        goto done;
    if ((rank = dyn_slots_get(&req_slots, req, Q_RANK)) == NULL || mark_stale(seqs, rank) < 0)
        goto done;
    if ((v = dyn_slots_get(&req_slots, req, Q_PREFILL)) == NULL ||
        update(&rank_slots, rank, R_PREFILL, PyNumber_Subtract, v) < 0)
        goto done;
    Py_CLEAR(v);
    PyObject *one = PyLong_FromLong(1);
    int rc = one == NULL ? -1 : update(&rank_slots, rank, R_REQUESTS, PyNumber_Subtract, one);
    Py_XDECREF(one);
    if (rc < 0)
        goto done;
    if ((v = dyn_slots_get(&req_slots, req, Q_PRIVATE)) == NULL ||
        update(&rank_slots, rank, R_PRIVATE, PyNumber_Subtract, v) < 0)
        goto done;
    if ((keys = dyn_slots_get(&req_slots, req, Q_KEYS)) == NULL)
        goto done;
    int any = PyObject_IsTrue(keys);
    if (any < 0)
        goto done;
    if (any) {
        PyObject *blocks = dyn_slots_get(&rank_slots, rank, R_BLOCKS);
        if (blocks == NULL)
            goto done;
        PyObject *call[2] = {blocks, keys};
        PyObject *r = PyObject_VectorcallMethod(str_remove_prefix_keys, call,
                                                2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(blocks);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    out = Py_NewRef(Py_True);
done:
    Py_DECREF(requests);
    Py_DECREF(req);
    Py_XDECREF(rank);
    Py_XDECREF(v);
    Py_XDECREF(keys);
    return out;
}

static PyMethodDef methods[] = {
    {"add_routed", (PyCFunction)(void (*)(void))add_routed, METH_FASTCALL, NULL},
    {"mark_prefill_completed", (PyCFunction)(void (*)(void))mark_prefill_completed,
     METH_FASTCALL, NULL},
    {"free", (PyCFunction)(void (*)(void))free_request, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_active",
    "A request's load into and out of ActiveSequences (contract: _active.pyi; fallback: "
    "_active_fallback.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__active(void)
{
    if (dyn_slots_init(&seq_slots) < 0 || dyn_slots_init(&rank_slots) < 0 ||
        dyn_slots_init(&req_slots) < 0)
        return NULL;
    if ((str_expire_stale = PyUnicode_InternFromString("expire_stale")) == NULL ||
        (str_add_prefix_keys = PyUnicode_InternFromString("add_prefix_keys")) == NULL ||
        (str_remove_prefix_keys = PyUnicode_InternFromString("remove_prefix_keys")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}

/*
 * dynamo.engine_core._sequence: an object of a slotted class built from its slot values, at
 * their offsets, without its ``__init__`` (``engine_core.sequence.new_sequence``: one
 * ``Sequence`` per request, live in the mocker and in the offline replay).
 *
 * Why native: the ``Sequence`` dataclass's generated ``__init__`` takes 27 fields by keyword
 * and its ``__post_init__`` runs on every request (~1.6 µs a sequence, about 1 % of the
 * offline replay's CPU); storing 26 pointers costs a fraction of that. The caller computes
 * every value as ``__init__`` and ``__post_init__`` would (tests/unit/engine_core/
 * test_sequence_native.py holds the two constructions to the same fields).
 *
 * The slots are the class's ``__slots__`` in order (a ``@dataclass(slots=True)``'s field
 * order), each a plain writable object slot; their offsets are learned once per class (the
 * last class seen), any other class is refused with TypeError. The contract is
 * ``_sequence.pyi``; ``_sequence_fallback.py`` is the same in Python.
 *
 * ``new_sequence`` computes those values too: the request's checks and fields, what the Python
 * ``new_sequence`` computes (~14k instructions a call, the replay's and the live engines' one
 * sequence a request), from a common call: four positional arguments, keyword arguments by
 * their names, exact ints for the limits and strs for the ids and the mode. Any other call,
 * and every request it refuses, goes to the Python one (``_sequence_fallback.new_sequence``),
 * which raises the errors with their messages; so the two give the same result for every call
 * (tests/unit/engine_core/test_sequence_native.py on random requests and refusals).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "../_import.h"
#include "_frozen.h"

#define MAX_SLOTS 64
#define SEQUENCE_FIELDS 28 /* the Sequence's, in order (sequence.py) */

static PyTypeObject *learned;          /* the class whose offsets are known (strong) */
static Py_ssize_t offsets[MAX_SLOTS]; /* its slots' offsets, in __slots__ order */
static Py_ssize_t n_slots;

/* Learn ``cls``'s slot offsets: 0, or -1 with TypeError if a slot is not a plain object slot. */
static int
learn(PyTypeObject *cls)
{
    PyObject *names = PyObject_GetAttrString((PyObject *)cls, "__slots__");
    if (names == NULL || PyUnicode_Check(names)) { /* none, or one named by a string */
        PyErr_Clear();
        Py_XDECREF(names);
        PyErr_SetString(PyExc_TypeError, "build() needs a class of plain object slots");
        return -1;
    }
    PyObject *seq = PySequence_Fast(names, "__slots__ must be a sequence of names");
    Py_DECREF(names);
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t found[MAX_SLOTS];
    int ok = n <= MAX_SLOTS && cls->tp_alloc != NULL;
    for (Py_ssize_t k = 0; ok && k < n; k++) {
        PyObject *d = PyObject_GetAttr((PyObject *)cls, PySequence_Fast_GET_ITEM(seq, k));
        if (d == NULL) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        ok = Py_IS_TYPE(d, &PyMemberDescr_Type);
        if (ok) {
            PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
            ok = m->type == T_OBJECT_EX && !(m->flags & READONLY);
            found[k] = m->offset;
        }
        Py_DECREF(d);
    }
    Py_DECREF(seq);
    if (!ok) {
        PyErr_SetString(PyExc_TypeError, "build() needs a class of plain object slots");
        return -1;
    }
    memcpy(offsets, found, sizeof(Py_ssize_t) * (size_t)n);
    n_slots = n;
    Py_XSETREF(learned, (PyTypeObject *)Py_NewRef(cls));
    return 0;
}

static PyObject *
build(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyType_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "build(cls, values: tuple)");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)args[0];
    PyObject *values = args[1];
    if (cls != learned && learn(cls) < 0)
        return NULL;
    if (PyTuple_GET_SIZE(values) != n_slots) {
        PyErr_SetString(PyExc_ValueError, "build() needs one value per slot");
        return NULL;
    }
    PyObject *obj = cls->tp_alloc(cls, 0);
    if (obj == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < n_slots; k++)
        *(PyObject **)((char *)obj + offsets[k]) = Py_NewRef(PyTuple_GET_ITEM(values, k));
    return obj;
}

/* -- new_sequence --------------------------------------------------------------------------- */

enum {
    K_MAX_TOKENS, K_MIN_TOKENS, K_STOP, K_EOS, K_IGNORE_EOS, K_LORA, K_SEED, K_HANDOFF, K_REUSE,
    K_SEED_ID, K_HASHES, NKW
};
static const char *const kw_texts[NKW] = {
    "max_tokens", "min_tokens", "stop_token_ids", "eos_token_ids", "ignore_eos", "lora_name",
    "seed", "handoff", "reuse_prefix_cache", "seed_id", "hashes",
};
static PyObject *kw_names[NKW];
static PyObject *a_max_model_len, *a_disaggregation_mode, *a_block_size, *a_num_gpu_blocks,
    *a_enable_chunked_prefill, *a_max_num_batched_tokens, *a_lora_kw;

/* Learned at the first call (the Python modules import this one): strong references. */
static PyObject *py_new_sequence, *sequence_cls, *st_waiting, *no_ids, *hash_fn, *block_seed_fn,
    *local_hashes_fn, *chain_fn, *default_seed, *mask64, *float_zero;
static PyObject *default_min, *empty_tuple; /* the Python signature's defaults 0 and () */

static PyObject *
attr_of(const char *module, const char *name)
{
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL)
        return NULL;
    PyObject *v = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return v;
}

static int
ready(void)
{
    if (float_zero != NULL)
        return 0;
    PyObject *status = NULL;
    if ((py_new_sequence = attr_of("dynamo.engine_core._sequence_fallback", "new_sequence")) ==
            NULL ||
        (no_ids = attr_of("dynamo.engine_core._sequence_fallback", "_NO_IDS")) == NULL ||
        (sequence_cls = attr_of("dynamo.engine_core.sequence", "Sequence")) == NULL ||
        (status = attr_of("dynamo.engine_core.sequence", "SequenceStatus")) == NULL ||
        (st_waiting = PyObject_GetAttrString(status, "WAITING")) == NULL ||
        (hash_fn = attr_of("xxhash", "xxh3_64_intdigest")) == NULL ||
        (block_seed_fn = attr_of("dynamo.router.hashing", "block_seed")) == NULL ||
        (local_hashes_fn = attr_of("dynamo.router.hashing", "local_block_hashes")) == NULL ||
        (chain_fn = attr_of("dynamo.router.hashing", "sequence_hashes")) == NULL ||
        (default_seed = PyObject_CallNoArgs(block_seed_fn)) == NULL ||
        (mask64 = PyLong_FromUnsignedLongLong(UINT64_MAX)) == NULL ||
        (a_lora_kw = Py_BuildValue("(s)", "lora_name")) == NULL) {
        Py_XDECREF(status);
        return -1;
    }
    Py_DECREF(status);
    if (!PyType_Check(sequence_cls)) {
        PyErr_SetString(PyExc_TypeError, "dynamo.engine_core.sequence.Sequence is not a class");
        return -1;
    }
    float_zero = PyFloat_FromDouble(0.0); /* last: its presence says everything is set */
    return float_zero == NULL ? -1 : 0;
}

/* An exact int attribute of ``config`` in *out (its object in *obj, new reference, if asked):
 * 1; 0 when it is anything else (the Python path decides); -1 is never returned: a failing
 * getattr also leaves it to the Python path, which raises it. */
static int
config_int(PyObject *config, PyObject *name, long long *out, PyObject **obj)
{
    PyObject *v = PyObject_GetAttr(config, name);
    if (v == NULL) {
        PyErr_Clear();
        return 0;
    }
    int overflow = 0;
    *out = PyLong_CheckExact(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : 0;
    if (!PyLong_CheckExact(v) || overflow) {
        Py_DECREF(v);
        return 0;
    }
    if (obj != NULL)
        *obj = v;
    else
        Py_DECREF(v);
    return 1;
}

/* The config's limits a request is checked against. */
typedef struct {
    long long max_len, bs, num_blocks, max_batched; /* max_batched: read when not chunked */
    PyObject *bs_obj; /* block_size's object (strong) */
    int prefill, decode, chunked;
} Limits;

/* The last config whose limits were read, when it is a frozen dataclass (the mocker's
 * ``MockerConfig``, the replay's): held, so its identity says its values, which are then not
 * read again a request (five or six attribute lookups). Any other config is read every call. */
static PyObject *limits_of;
static Limits limits_kept;

/* ``config``'s limits into *l (``l->bs_obj`` a new reference): 1; 0 when one is not what the
 * C path reads (the Python path decides, and raises what it raises). */
static int
read_limits(PyObject *config, Limits *l)
{
    if (config == limits_of) {
        *l = limits_kept;
        Py_INCREF(l->bs_obj);
        return 1;
    }
    l->bs_obj = NULL;
    if (!config_int(config, a_max_model_len, &l->max_len, NULL) ||
        !config_int(config, a_block_size, &l->bs, &l->bs_obj) ||
        !config_int(config, a_num_gpu_blocks, &l->num_blocks, NULL) || l->bs < 1)
        goto python;
    PyObject *mode = PyObject_GetAttr(config, a_disaggregation_mode);
    if (mode == NULL) {
        PyErr_Clear();
        goto python;
    }
    int text = PyUnicode_CheckExact(mode);
    l->prefill = text && PyUnicode_CompareWithASCIIString(mode, "prefill") == 0;
    l->decode = text && PyUnicode_CompareWithASCIIString(mode, "decode") == 0;
    Py_DECREF(mode);
    if (!text)
        goto python;
    PyObject *chunked = PyObject_GetAttr(config, a_enable_chunked_prefill);
    l->chunked = chunked == NULL ? -1 : PyObject_IsTrue(chunked);
    Py_XDECREF(chunked);
    if (l->chunked < 0) {
        PyErr_Clear();
        goto python;
    }
    l->max_batched = 0;
    if (!l->chunked && !config_int(config, a_max_num_batched_tokens, &l->max_batched, NULL))
        goto python;
    if (dyn_frozen_dataclass(config)) {
        Py_XDECREF(limits_kept.bs_obj);
        Py_XSETREF(limits_of, Py_NewRef(config));
        limits_kept = *l;
        Py_INCREF(limits_kept.bs_obj);
    }
    return 1;
python:
    Py_CLEAR(l->bs_obj);
    return 0;
}

/* An exact int argument's value: 1, or 0 for anything else. */
static int
exact_int(PyObject *v, long long *out)
{
    int overflow = 0;
    if (!PyLong_CheckExact(v))
        return 0;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    return !overflow;
}

/* ``frozenset(ids) if ids else _NO_IDS`` (new reference), or NULL with an exception. */
static PyObject *
id_set(PyObject *ids)
{
    int t = PyObject_IsTrue(ids);
    if (t < 0)
        return NULL;
    return t ? PyFrozenSet_New(ids) : Py_NewRef(no_ids);
}

static PyObject *array_type; /* array.array */

/* A prompt's length: a list's, or a packed prompt's (an exact ``array('I')``: the offline
 * replay's, kept as it is, as a list is); -1 for anything else (copied by the Python path). */
static Py_ssize_t
prompt_len(PyObject *tokens)
{
    if (PyList_CheckExact(tokens))
        return PyList_GET_SIZE(tokens);
    if (!Py_IS_TYPE(tokens, (PyTypeObject *)array_type))
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t n = view.itemsize == 4 && view.format != NULL && view.format[0] == 'I' &&
                           view.format[1] == '\0'
                       ? view.len / 4
                       : -1;
    PyBuffer_Release(&view);
    return n;
}

/* The request's fields computed in C into v[] (new references): 1; 0 when the call is for
 * the Python path (v[] released, no exception); -1 with an exception. */
static int
compute(PyObject *const *args, PyObject *const *kw, PyObject **v)
{
    PyObject *config = args[0], *tokens = args[1], *rid = args[2], *now = args[3];
    PyObject *bs_obj = NULL, *hashes = kw[K_HASHES], *local = NULL, *chained = NULL;
    long long max_tokens, min_tokens;
    int rc = 0;
    Py_ssize_t isl = prompt_len(tokens);
    PyObject *seed_id = kw[K_SEED_ID];
    Limits lim;
    if (isl < 1 || !PyUnicode_CheckExact(rid) ||
        (seed_id != Py_None && !PyUnicode_CheckExact(seed_id)) || !read_limits(config, &lim))
        goto done; /* a list or packed prompt only: anything else is copied by the Python path */
    bs_obj = lim.bs_obj;
    long long max_len = lim.max_len, bs = lim.bs, num_blocks = lim.num_blocks;
    int prefill = lim.prefill, decode = lim.decode;
    long long room = max_len - (long long)isl;
    PyObject *max_obj = kw[K_MAX_TOKENS], *min_obj = kw[K_MIN_TOKENS];
    if (prefill) {
        max_tokens = 1, min_tokens = 0;
        max_obj = NULL, min_obj = NULL;
    } else {
        if (max_obj == Py_None) {
            max_tokens = room;
            max_obj = NULL;
        } else if (!exact_int(max_obj, &max_tokens)) {
            goto done;
        }
        if (!exact_int(min_obj, &min_tokens))
            goto done;
    }
    if (room < 1 || max_tokens < 1 || max_tokens > room || min_tokens > max_tokens)
        goto done; /* refused: the Python path raises */
    long long kv_tokens = (long long)isl + max_tokens - 1;
    if ((kv_tokens + bs - 1) / bs > num_blocks)
        goto done;
    if (!lim.chunked && (long long)isl > lim.max_batched)
        goto done;
    /* hashes handed over when they cover the prompt's complete blocks */
    if (hashes != Py_None) {
        if (!PyTuple_CheckExact(hashes) || PyTuple_GET_SIZE(hashes) != 2)
            goto done;
        Py_ssize_t n = PyObject_Length(PyTuple_GET_ITEM(hashes, 0));
        if (n < 0) {
            PyErr_Clear();
            goto done;
        }
        if (n == (Py_ssize_t)(isl / bs)) {
            local = Py_NewRef(PyTuple_GET_ITEM(hashes, 0));
            chained = Py_NewRef(PyTuple_GET_ITEM(hashes, 1));
        }
    }
    /* the values that can raise, in the Python path's order (its errors are the same) */
    rc = -1;
    PyObject *eos = id_set(kw[K_EOS]), *stops = eos ? id_set(kw[K_STOP]) : NULL;
    v[9] = eos;
    if (stops == NULL)
        goto done;
    int ignore = PyObject_IsTrue(kw[K_IGNORE_EOS]);
    if (ignore < 0) {
        Py_DECREF(stops);
        goto done;
    }
    if (ignore) {
        v[8] = stops;
    } else {
        v[8] = PyNumber_Or(stops, eos);
        Py_DECREF(stops);
        if (v[8] == NULL)
            goto done;
    }
    if (local == NULL) { /* not handed in: hashed as Sequence.__post_init__ does */
        PyObject *argv[3] = {tokens, bs_obj, kw[K_LORA]};
        if ((local = PyObject_Vectorcall(local_hashes_fn, argv, 2, a_lora_kw)) == NULL ||
            (chained = PyObject_CallOneArg(chain_fn, local)) == NULL)
            goto done;
    }
    /* request_seed(seed_id or request_id, seed) & 2**64 - 1 */
    PyObject *seed = kw[K_SEED], *rng;
    if (seed != Py_None) {
        rng = PyNumber_And(seed, mask64);
    } else {
        PyObject *source = kw[K_SEED_ID];
        int t = PyObject_IsTrue(source);
        if (t < 0)
            goto done;
        PyObject *bytes = PyUnicode_AsUTF8String(t ? source : rid);
        if (bytes == NULL)
            goto done;
        PyObject *h = PyObject_CallOneArg(hash_fn, bytes);
        Py_DECREF(bytes);
        rng = h == NULL ? NULL : PyNumber_And(h, mask64);
        Py_XDECREF(h);
    }
    if ((v[7] = rng) == NULL)
        goto done;
    PyObject *lora = kw[K_LORA];
    v[26] = lora == Py_None ? Py_NewRef(default_seed) : PyObject_CallOneArg(block_seed_fn, lora);
    if (v[26] == NULL || (v[2] = PyLong_FromSsize_t(isl)) == NULL ||
        (v[3] = max_obj != NULL ? Py_NewRef(max_obj) : PyLong_FromLongLong(max_tokens)) == NULL ||
        (v[4] = min_obj != NULL ? Py_NewRef(min_obj) : PyLong_FromLongLong(min_tokens)) == NULL ||
        (v[21] = PyList_New(0)) == NULL || (v[24] = PyList_New(0)) == NULL ||
        (v[25] = PyList_New(0)) == NULL)
        goto done;
    PyObject *handoff = decode ? kw[K_HANDOFF] : Py_None;
    v[0] = Py_NewRef(rid);
    v[1] = Py_NewRef(tokens); /* the prompt: kept */
    v[5] = Py_NewRef(bs_obj);
    v[6] = Py_NewRef(lora);
    v[10] = Py_NewRef(now);
    v[11] = Py_NewRef(handoff);
    v[12] = Py_NewRef(handoff != Py_None ? Py_True : Py_False); /* pending_transfer */
    v[13] = Py_NewRef(kw[K_REUSE]);
    v[14] = Py_NewRef(st_waiting);
    v[15] = PyLong_FromLong(0); /* num_computed_tokens (a small int: never fails) */
    v[16] = PyLong_FromLong(0); /* prefill_end */
    v[17] = Py_NewRef(Py_None); /* num_cached_tokens */
    v[18] = Py_NewRef(float_zero); /* ready_at */
    v[19] = PyLong_FromLong(0); /* num_preemptions */
    v[20] = Py_NewRef(Py_None); /* finish_reason */
    v[27] = Py_NewRef(Py_None); /* full_slots */
    v[22] = local, v[23] = chained;
    local = chained = NULL;
    rc = 1;
done:
    Py_XDECREF(bs_obj);
    Py_XDECREF(local);
    Py_XDECREF(chained);
    if (rc <= 0) {
        for (int k = 0; k < SEQUENCE_FIELDS; k++)
            Py_CLEAR(v[k]);
    }
    return rc;
}

static PyObject *
new_sequence(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (ready() < 0)
        return NULL;
    PyObject *kw[NKW] = {NULL};
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs != 4)
        goto python;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        int k = 0;
        while (k < NKW && name != kw_names[k])
            k++;
        for (int j = 0; k == NKW && j < NKW; j++)
            if (PyUnicode_Compare(name, kw_names[j]) == 0)
                k = j;
        if (PyErr_Occurred())
            return NULL;
        if (k == NKW || kw[k] != NULL)
            goto python; /* an unknown or repeated name: the Python path's TypeError */
        kw[k] = args[nargs + i];
    }
    if (kw[K_MAX_TOKENS] == NULL)
        goto python;
    if (kw[K_MIN_TOKENS] == NULL)
        kw[K_MIN_TOKENS] = default_min;
    if (kw[K_STOP] == NULL)
        kw[K_STOP] = empty_tuple;
    if (kw[K_EOS] == NULL)
        kw[K_EOS] = empty_tuple;
    if (kw[K_IGNORE_EOS] == NULL)
        kw[K_IGNORE_EOS] = Py_False;
    if (kw[K_REUSE] == NULL)
        kw[K_REUSE] = Py_True;
    for (int k = 0; k < NKW; k++)
        if (kw[k] == NULL)
            kw[k] = Py_None; /* lora_name, seed, handoff, seed_id, hashes */
    if (learned != (PyTypeObject *)sequence_cls && learn((PyTypeObject *)sequence_cls) < 0)
        return NULL;
    if (n_slots != SEQUENCE_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "new_sequence() needs the Sequence's 28 fields");
        return NULL;
    }
    PyObject *v[SEQUENCE_FIELDS] = {NULL};
    int rc = compute(args, kw, v);
    if (rc < 0)
        return NULL;
    if (rc == 0)
        goto python;
    PyTypeObject *cls = (PyTypeObject *)sequence_cls;
    PyObject *obj = cls->tp_alloc(cls, 0);
    if (obj == NULL) {
        for (int k = 0; k < SEQUENCE_FIELDS; k++)
            Py_DECREF(v[k]);
        return NULL;
    }
    for (int k = 0; k < SEQUENCE_FIELDS; k++)
        *(PyObject **)((char *)obj + offsets[k]) = v[k]; /* stolen */
    return obj;
python:
    return PyObject_Vectorcall(py_new_sequence, args, (size_t)nargs, kwnames);
}

static PyMethodDef module_methods[] = {
    {"build", (PyCFunction)(void (*)(void))build, METH_FASTCALL,
     "build(cls, values): an object of the slotted class cls, its slots set to values."},
    {"new_sequence", (PyCFunction)(void (*)(void))new_sequence,
     METH_FASTCALL | METH_KEYWORDS, "new_sequence(config, token_ids, request_id, now, *, ...)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sequence_module = {
    PyModuleDef_HEAD_INIT, "dynamo.engine_core._sequence",
    "A slotted object built from its slot values in C (see _sequence.pyi).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__sequence(void)
{
    for (int k = 0; k < NKW; k++)
        if (kw_names[k] == NULL && (kw_names[k] = PyUnicode_InternFromString(kw_texts[k])) == NULL)
            return NULL;
#define INTERN(var, text)                                                                     \
    if (var == NULL && (var = PyUnicode_InternFromString(text)) == NULL)                       \
        return NULL;
    INTERN(a_max_model_len, "max_model_len");
    INTERN(a_disaggregation_mode, "disaggregation_mode");
    INTERN(a_block_size, "block_size");
    INTERN(a_num_gpu_blocks, "num_gpu_blocks");
    INTERN(a_enable_chunked_prefill, "enable_chunked_prefill");
    INTERN(a_max_num_batched_tokens, "max_num_batched_tokens");
#undef INTERN
    if ((default_min == NULL && (default_min = PyLong_FromLong(0)) == NULL) ||
        (empty_tuple == NULL && (empty_tuple = PyTuple_New(0)) == NULL))
        return NULL;
    if (array_type == NULL && (array_type = dyn_import_attr("array", "array")) == NULL)
        return NULL;
    return PyModule_Create(&sequence_module);
}

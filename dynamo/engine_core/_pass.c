/*
 * dynamo.engine_core._pass: one scheduler pass of one DP rank in two calls, ``schedule_pass``
 * (plan, grow, preempt, admit, allocate) and ``update_pass`` (advance, promote filled blocks,
 * append and hash tokens, stop rules, retire the finished, drain the KV events), plus the
 * mocker's sampler.
 *
 * Why native: the offline replay runs millions of passes, and the scheduler's per-pass Python
 * (its loops, the per-sequence attribute traffic, the callbacks between the C loops and the
 * Python policy) was most of what separated it from the reference's Rust replay
 * (docs/performance.md, "Offline replay"); the live mocker and the PyTorch engine run the same
 * pass. The contract is ``_pass.pyi``; ``_pass_fallback.py`` is the same contract in Python
 * (``dynamo.native`` picks one), and tests/unit/engine_core/test_pass_kernels.py holds the two
 * to the same results on random workloads.
 *
 * Sequences are the scheduler's ``Sequence`` objects (a slotted dataclass). Their slots are read
 * and written in place: the offsets of the class's member descriptors are learned once, so a
 * field access is a load, not an attribute lookup (any other object goes through getattr /
 * setattr, with the same results). The KV manager is called through its public methods, so
 * either of its implementations works; with the native one an admission converts the prompt's
 * chain of hashes once and makes its three calls in C, and filled blocks are promoted and a
 * sequence's blocks released from its lists' items in C (``_kv_api.h``).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "../_slots.h"
#include "../_u64.h"
#include "_frozen.h"
#include "_kv_api.h"

/* XXH3-64, the block hash (router/_hash.c's vendored reference implementation, the algorithm
 * the Python ``xxhash`` package wraps) */
#define XXH_INLINE_ALL
#define XXH_NO_STREAM
#include "../router/vendor/xxhash.h"

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define LCG_MUL 6364136223846793005ULL
#define LCG_INC 1442695040888963407ULL
#define SEQUENCE_SEED 1337ULL /* router.hashing.XXH3_SEED: the seed of the chained hash */

/* -- the Sequence's fields ----------------------------------------------------------------- */

enum {
    F_PROMPT, F_NUM_PROMPT_TOKENS, F_MAX_TOKENS, F_MIN_TOKENS, F_RNG_STATE, F_STOP_TOKEN_IDS,
    F_BANNED_TOKEN_IDS, F_PENDING_TRANSFER, F_REUSE_PREFIX_CACHE, F_STATUS,
    F_NUM_COMPUTED_TOKENS, F_PREFILL_END, F_NUM_CACHED_TOKENS, F_READY_AT, F_NUM_PREEMPTIONS,
    F_FINISH_REASON, F_LOCAL_HASHES, F_BLOCK_HASHES, F_FULL_BLOCKS, F_UNIQUE_BLOCKS,
    F_HASH_SEED, F_REQUEST_ID, F_HANDOFF, F_OUTPUT, F_FULL_SLOTS, NFIELDS
};

static const char *const field_names[NFIELDS] = {
    "prompt", "num_prompt_tokens", "max_tokens", "min_tokens", "rng_state", "stop_token_ids",
    "banned_token_ids", "pending_transfer", "reuse_prefix_cache", "status",
    "num_computed_tokens", "prefill_end", "num_cached_tokens", "ready_at", "num_preemptions",
    "finish_reason", "local_hashes", "block_hashes", "full_blocks", "unique_blocks",
    "hash_seed", "request_id", "handoff", "output", "full_slots",
};

/* The Sequence class's slot offsets (learned from it at the first call, ``ensure_ready``). */
static DynSlots seq_slots = DYN_SLOTS_OF(field_names);

/* Names of the collaborators' attributes and methods (interned at import). */
static PyObject *s_num_cached_prefix, *s_num_slots_needed, *s_num_available_blocks, *s_use,
    *s_allocate_unique, *s_promote_run, *s_release, *s_drain_events,
    *s_drain_raw_events, *s_raw_events, *s_enable_prefix_caching,
    *s_max_num_batched_tokens, *s_block_size, *s_preemption_mode, *s_max_num_seqs,
    *s_enable_chunked_prefill, *s_popleft, *s_appendleft, *s_announce_kw, *s_num_cached_tokens;

/* The native KV manager's admission calls (_kv_api.h), or NULL (not built: the methods). */
static const DynKVApi *kv_api;

/* Learned once from dynamo.engine_core.sequence / dynamo.protocol.output (strong refs). */
static PyObject *st_waiting, *st_running, *st_finished, *fr_length, *fr_stop, *hash_fn;

static PyObject *
attr_of(const char *module, const char *dotted_a, const char *b)
{
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL)
        return NULL;
    PyObject *a = PyObject_GetAttrString(m, dotted_a);
    Py_DECREF(m);
    if (a == NULL || b == NULL)
        return a;
    PyObject *v = PyObject_GetAttrString(a, b);
    Py_DECREF(a);
    return v;
}

/* The enums, the hash function and the Sequence class: imported at the first call (the
 * sequence module imports the router's hashing; importing it from PyInit would be a cycle). */
static int
ensure_ready(void)
{
    if (st_running != NULL)
        return 0;
    PyObject *cls = attr_of("dynamo.engine_core.sequence", "Sequence", NULL);
    if (cls == NULL)
        return -1;
    if (PyType_Check(cls))
        dyn_slots_learn(&seq_slots, (PyTypeObject *)cls);
    Py_DECREF(cls);
    if ((st_waiting = attr_of("dynamo.engine_core.sequence", "SequenceStatus", "WAITING")) ==
            NULL ||
        (st_finished = attr_of("dynamo.engine_core.sequence", "SequenceStatus", "FINISHED")) ==
            NULL ||
        (fr_length = attr_of("dynamo.protocol.output", "FinishReason", "LENGTH")) == NULL ||
        (fr_stop = attr_of("dynamo.protocol.output", "FinishReason", "STOP")) == NULL ||
        (hash_fn = attr_of("xxhash", "xxh3_64_intdigest", NULL)) == NULL)
        return -1;
    if ((kv_api = PyCapsule_Import(DYN_KV_API_CAPSULE, 0)) == NULL)
        PyErr_Clear(); /* the native KV manager is not built: its methods are called */
    /* last: its presence says everything above is set */
    st_running = attr_of("dynamo.engine_core.sequence", "SequenceStatus", "RUNNING");
    return st_running == NULL ? -1 : 0;
}

/* A field's value (new reference), or NULL with an exception. */
static inline PyObject *
get(PyObject *seq, int f)
{
    return dyn_slots_get(&seq_slots, seq, f);
}

/* Set a field to ``v`` (not stolen). */
static inline int
put(PyObject *seq, int f, PyObject *v)
{
    return dyn_slots_put(&seq_slots, seq, f, v);
}

/* Set a field to a new reference ``v`` (stolen; NULL: the error that made it). */
static int
put_new(PyObject *seq, int f, PyObject *v)
{
    if (v == NULL)
        return -1;
    int rc = put(seq, f, v);
    Py_DECREF(v);
    return rc;
}

/* A field's value, borrowed, when ``seq`` is of the learned class and the slot is set; NULL
 * otherwise, with no exception (the caller then takes the general path, ``get``). The fields
 * read every pass for a sequence's counts, lists' lengths and status: no reference taken and
 * dropped, no call (these reads were ~10k instructions a replayed request as calls). */
static inline PyObject *
peek(PyObject *seq, int f)
{
    if (Py_TYPE(seq) != seq_slots.type)
        return NULL;
    return *(PyObject **)((char *)seq + seq_slots.offsets[f]);
}

/* get_ssize's general path: any object, any int (``PyLong_AsSsize_t``'s result and errors). */
static int
get_ssize_slow(PyObject *seq, int f, Py_ssize_t *out)
{
    PyObject *v = get(seq, f);
    if (v == NULL)
        return -1;
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* An int field's value: the fields read every pass (token counts, limits) are exact ints of
 * at most one digit, read from it (CPython 3.11's layout, as ``dyn_u64_digits``); any other
 * value goes through ``PyLong_AsSsize_t``, with the same result and errors. */
static inline int
get_ssize(PyObject *seq, int f, Py_ssize_t *out)
{
#if PY_VERSION_HEX < 0x030C0000
    PyObject *v = peek(seq, f);
    if (v != NULL && PyLong_CheckExact(v)) {
        Py_ssize_t size = Py_SIZE(v);
        if (size == 0 || size == 1 || size == -1) {
            *out = size == 0 ? 0 : size * (Py_ssize_t)((PyLongObject *)v)->ob_digit[0];
            return 0;
        }
    }
#endif
    return get_ssize_slow(seq, f, out);
}

/* The int objects of the token counts the pass writes (``num_computed_tokens`` after every
 * step, ``prefill_end``, ``num_cached_tokens``) and of the ids the sampler draws, made once a
 * value and shared, as CPython shares the small ints: a decode step's new count and its token
 * were two allocations, and their freeing, per sequence and pass. Bounded (COUNT_INTS values,
 * ~32 bytes each once made, for the module's life; the table's untouched pages cost nothing). */
#define COUNT_INTS (1 << 17)
static PyObject *count_ints[COUNT_INTS];

/* ``int(n)`` (new reference), or NULL with an exception. */
static inline PyObject *
count_int(Py_ssize_t n)
{
    if (n < 0 || n >= COUNT_INTS)
        return PyLong_FromSsize_t(n);
    PyObject *v = count_ints[n];
    if (v == NULL && (v = count_ints[n] = PyLong_FromSsize_t(n)) == NULL)
        return NULL;
    return Py_NewRef(v);
}

static inline int
put_ssize(PyObject *seq, int f, Py_ssize_t n)
{
    return put_new(seq, f, count_int(n));
}

/* get_bool's general path (any object, any value). */
static int
get_bool_slow(PyObject *seq, int f)
{
    PyObject *v = get(seq, f);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* The truth of a field: 1, 0, or -1 on error. The flags read every pass (``pending_transfer``,
 * ``reuse_prefix_cache``) are True or False: read by identity, borrowed (no call). */
static inline int
get_bool(PyObject *seq, int f)
{
    PyObject *v = peek(seq, f);
    if (v == Py_False)
        return 0;
    if (v == Py_True)
        return 1;
    return get_bool_slow(seq, f);
}

/* len() of a field: its general path (any object). */
static Py_ssize_t
len_of_slow(PyObject *seq, int f)
{
    PyObject *v = get(seq, f);
    if (v == NULL)
        return -1;
    Py_ssize_t n = PyList_CheckExact(v) ? PyList_GET_SIZE(v) : PyObject_Length(v);
    Py_DECREF(v);
    return n;
}

/* len() of a field (a list on the fast path). */
static inline Py_ssize_t
len_of(PyObject *seq, int f)
{
    PyObject *v = peek(seq, f);
    if (v != NULL && PyList_CheckExact(v))
        return PyList_GET_SIZE(v);
    return len_of_slow(seq, f);
}

/* Sequence.num_tokens: the prompt's tokens and the sampled ones, or -1 with an exception. */
static inline Py_ssize_t
num_tokens(PyObject *seq)
{
    Py_ssize_t prompt, output = len_of(seq, F_OUTPUT);
    if (output < 0 || get_ssize(seq, F_NUM_PROMPT_TOKENS, &prompt) < 0)
        return -1;
    return prompt + output;
}

/* Whether the sequence's status is ``status`` (identity, as ``is``): 1, 0, -1. */
static inline int
status_is(PyObject *seq, PyObject *status)
{
    PyObject *v = peek(seq, F_STATUS);
    if (v != NULL)
        return v == status;
    v = get(seq, F_STATUS);
    if (v == NULL)
        return -1;
    Py_DECREF(v); /* identity only: the enum member lives on in its class */
    return v == status;
}

/* An int result of a call (stolen), or -1 with an exception. */
static Py_ssize_t
as_ssize(PyObject *v)
{
    if (v == NULL)
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return n;
}

static int
config_ssize(PyObject *config, PyObject *name, Py_ssize_t *out)
{
    *out = as_ssize(PyObject_GetAttr(config, name));
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int
config_bool(PyObject *config, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(config, name);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static Py_ssize_t
ceil_div(Py_ssize_t a, Py_ssize_t b)
{
    return a > 0 ? (a + b - 1) / b : -((-a) / b);
}

/* -- the sampler ---------------------------------------------------------------------------- */

static int
entry_parts(PyObject *entry, PyObject **seq, Py_ssize_t *n)
{
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
        PyErr_SetString(PyExc_TypeError, "a batch entry must be a (sequence, tokens) tuple");
        return -1;
    }
    *seq = PyTuple_GET_ITEM(entry, 0);
    *n = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
    return (*n == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* A pass's batch: a list of (sequence, tokens) tuples (the Python-facing calls), or the plan's
 * arrays of borrowed sequences and counts (``mock_pass``: no tuple a batch entry). */
typedef struct {
    PyObject *list;
    PyObject *const *seq;
    const Py_ssize_t *n;
    Py_ssize_t count;
    /* the plan's: each sequence's tokens and computed tokens as planned (``mock_pass`` samples
     * and applies the batch in the same call: nothing changes them in between); NULL: read */
    const Py_ssize_t *ntok, *computed;
} Batch;

static inline int
batch_at(const Batch *b, Py_ssize_t i, PyObject **seq, Py_ssize_t *n)
{
    if (b->list != NULL)
        return entry_parts(PyList_GET_ITEM(b->list, i), seq, n);
    *seq = b->seq[i];
    *n = b->n[i];
    return 0;
}

/* 1 if token is in the set (a frozenset or set; None or empty: never), 0 if not, -1 on error. */
static inline int
in_set(PyObject *set, PyObject *token)
{
    if (set == Py_None || PySet_GET_SIZE(set) == 0)
        return 0;
    return PySet_Contains(set, token);
}

static PyObject *sample_core(const Batch *b, unsigned long long vocab, PyObject *excluded);

/* The excluded ids as numbers: the mocker passes the same frozenset (its special ids) every
 * pass, so the last one is held (immutable: its identity says its content) with its members
 * as uint64s, their range first; a draw then is checked without an int object or a set
 * lookup. Only for a set of at most EXCL_MAX exact non-negative ints of 64 bits (equality
 * with an id is then equality of the numbers); any other: ``excl_n`` -1, the set is asked. */
enum { EXCL_MAX = 32 };
static PyObject *excl_set;
static uint64_t excl_ids[EXCL_MAX], excl_lo, excl_hi;
static int excl_n = -1;

/* The number of excluded ids as numbers (excl_ids), or -1: look them up in the set. */
static int
excluded_ids(PyObject *excluded)
{
    if (!PyFrozenSet_CheckExact(excluded))
        return -1;
    if (excluded == excl_set)
        return excl_n;
    int n = 0, usable = PySet_GET_SIZE(excluded) <= EXCL_MAX;
    PyObject *it = usable ? PyObject_GetIter(excluded) : NULL, *key;
    if (it == NULL) {
        PyErr_Clear(); /* the set answers instead */
        usable = 0;
    }
    while (usable && (key = PyIter_Next(it)) != NULL) {
        uint64_t v;
        if (n < EXCL_MAX && dyn_u64_digits(key, &v))
            excl_ids[n++] = v;
        else
            usable = 0;
        Py_DECREF(key);
    }
    Py_XDECREF(it);
    if (PyErr_Occurred()) { /* the iteration failed: the set answers instead */
        PyErr_Clear();
        usable = 0;
    }
    excl_lo = UINT64_MAX, excl_hi = 0;
    for (int k = 0; k < n; k++) {
        excl_lo = excl_ids[k] < excl_lo ? excl_ids[k] : excl_lo;
        excl_hi = excl_ids[k] > excl_hi ? excl_ids[k] : excl_hi;
    }
    Py_XSETREF(excl_set, Py_NewRef(excluded));
    excl_n = usable ? n : -1;
    return excl_n;
}

static inline int
excluded_id(uint64_t id, int n)
{
    if (id < excl_lo || id > excl_hi)
        return 0;
    for (int k = 0; k < n; k++)
        if (excl_ids[k] == id)
            return 1;
    return 0;
}

/* sample_tokens's checks of ``excluded`` and ``vocab_size``: 0, or -1 with the error. */
static int
sample_args(PyObject *vocab_obj, PyObject *excluded, unsigned long long *vocab)
{
    if (!PyAnySet_Check(excluded)) {
        PyErr_SetString(PyExc_TypeError, "excluded must be a set or frozenset");
        return -1;
    }
    if (ensure_ready() < 0)
        return -1;
    *vocab = PyLong_AsUnsignedLongLong(vocab_obj);
    return (*vocab == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *
sample_tokens(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sample_tokens(entries, vocab_size, excluded)");
        return NULL;
    }
    PyObject *entries = args[0];
    if (!PyList_Check(entries)) {
        PyErr_SetString(PyExc_TypeError, "entries must be a list");
        return NULL;
    }
    unsigned long long vocab;
    if (sample_args(args[1], args[2], &vocab) < 0)
        return NULL;
    Batch b = {.list = entries, .count = PyList_GET_SIZE(entries)};
    return sample_core(&b, vocab, args[2]);
}

/* The mocker's id of each entry of the batch that samples, None for the others. */
static PyObject *
sample_core(const Batch *b, unsigned long long vocab, PyObject *excluded)
{
    Py_ssize_t count = b->count;
    int nexcl = excluded_ids(excluded);
    PyObject *out = PyList_New(count);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *seq, *rng, *banned, *token = NULL;
        Py_ssize_t n, computed;
        if (batch_at(b, i, &seq, &n) < 0)
            goto fail;
        Py_ssize_t position;
        if (b->ntok != NULL) {
            position = b->ntok[i], computed = b->computed[i];
        } else if ((position = num_tokens(seq)) < 0 ||
                   get_ssize(seq, F_NUM_COMPUTED_TOKENS, &computed) < 0) {
            goto fail;
        }
        if (computed + n < position) {
            PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
            continue;
        }
        /* the state mod 2**64: read from its digits when it is an exact int in [0, 2**64)
         * (request_seed's are: masked to 64 bits), else through the API */
        uint64_t z;
        if ((rng = peek(seq, F_RNG_STATE)) == NULL || !dyn_u64_digits(rng, &z)) {
            if ((rng = get(seq, F_RNG_STATE)) == NULL)
                goto fail;
            z = PyLong_AsUnsignedLongLongMask(rng);
            Py_DECREF(rng);
            if (z == (uint64_t)-1 && PyErr_Occurred())
                goto fail;
        }
        /* SplitMix64's finaliser over (seed, position): as the fallback, bit for bit */
        z += GOLDEN * (uint64_t)(position + 1);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        uint64_t state = z ^ (z >> 31);
        if ((banned = get(seq, F_BANNED_TOKEN_IDS)) == NULL)
            goto fail;
        if (banned != Py_None && !PyAnySet_Check(banned)) {
            Py_DECREF(banned);
            PyErr_SetString(PyExc_TypeError, "banned_token_ids must be a set or frozenset");
            goto fail;
        }
        for (;;) {
            uint64_t id = (uint64_t)(((unsigned __int128)(state >> 32) * vocab) >> 32);
            if (nexcl < 0 || !excluded_id(id, nexcl)) {
                token = id < COUNT_INTS ? count_int((Py_ssize_t)id)
                                        : PyLong_FromUnsignedLongLong(id);
                if (token == NULL)
                    break;
                int hit = nexcl < 0 ? in_set(excluded, token) : 0;
                if (hit == 0)
                    hit = in_set(banned, token);
                if (hit == 0)
                    break;
                Py_CLEAR(token);
                if (hit < 0)
                    break;
            }
            state = state * LCG_MUL + LCG_INC;
        }
        Py_DECREF(banned);
        if (token == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, token);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* -- blocks --------------------------------------------------------------------------------- */

/* Whether ``kv`` is the native KV manager, whose calls C makes directly (_kv_api.h). */
static inline int
kv_native(PyObject *kv)
{
    return kv_api != NULL && Py_TYPE(kv) == kv_api->type;
}

/* -- a sequence's kept slots (``full_slots``: the native KV manager's slot of each full block,
 * native int32s in a bytearray; _kv_api.h) ------------------------------------------------ */

/* The kept slots of a sequence of the learned class whose ``full_slots`` describes ``n`` full
 * blocks, or NULL (none kept, or not for these blocks: the release looks the hashes up). */
static inline const int32_t *
kept_slots(PyObject *seq, Py_ssize_t n)
{
    PyObject *v = peek(seq, F_FULL_SLOTS);
    if (v == NULL || !PyByteArray_CheckExact(v) ||
        PyByteArray_GET_SIZE(v) != n * (Py_ssize_t)sizeof(int32_t))
        return NULL;
    return (const int32_t *)PyByteArray_AS_STRING(v);
}

/* ``full_slots`` becomes slots[:n] (a new bytearray), or None (``slots`` NULL): only on a
 * sequence of the learned class (any other keeps its own; the release never reads it). */
static int
keep_slots(PyObject *seq, const int32_t *slots, Py_ssize_t n)
{
    if (peek(seq, F_FULL_SLOTS) == NULL)
        return 0;
    if (slots == NULL)
        return put(seq, F_FULL_SLOTS, Py_None);
    return put_new(seq, F_FULL_SLOTS,
                   PyByteArray_FromStringAndSize((const char *)slots,
                                                 n * (Py_ssize_t)sizeof(int32_t)));
}

/* ``full_slots`` gets slots[:n] after its ``k`` (the full blocks before a promotion): appended
 * when it holds exactly k, made when k is 0, else None (unknown: the release looks up). */
static int
extend_slots(PyObject *seq, Py_ssize_t k, const int32_t *slots, Py_ssize_t n)
{
    PyObject *v = peek(seq, F_FULL_SLOTS);
    if (v == NULL)
        return 0;
    Py_ssize_t size = (Py_ssize_t)sizeof(int32_t);
    if (kept_slots(seq, k) != NULL && k > 0) {
        if (PyByteArray_Resize(v, (k + n) * size) < 0)
            return -1;
        memcpy(PyByteArray_AS_STRING(v) + k * size, slots, (size_t)(n * size));
        return 0;
    }
    return keep_slots(seq, k == 0 ? slots : NULL, n);
}

/* kv.release(full_blocks, unique_blocks); both fields become new empty lists. */
static int
release(PyObject *kv, PyObject *seq)
{
    PyObject *full = get(seq, F_FULL_BLOCKS);
    PyObject *unique = full ? get(seq, F_UNIQUE_BLOCKS) : NULL;
    int rc = -1;
    if (unique == NULL) {
    } else if (kv_native(kv) && PyList_CheckExact(full) && PyList_CheckExact(unique)) {
        /* the lists' items as they are, with the kept slots: the method's work without its
         * call, and without looking the hashes up */
        Py_ssize_t nfull = PyList_GET_SIZE(full);
        rc = kv_api->release(kv, PySequence_Fast_ITEMS(full), kept_slots(seq, nfull), nfull,
                             PySequence_Fast_ITEMS(unique), PyList_GET_SIZE(unique));
    } else {
        PyObject *argv[3] = {kv, full, unique};
        PyObject *r =
            PyObject_VectorcallMethod(s_release, argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_XDECREF(full);
    Py_XDECREF(unique);
    if (rc < 0)
        return -1;
    if (put_new(seq, F_FULL_BLOCKS, PyList_New(0)) < 0 ||
        put_new(seq, F_UNIQUE_BLOCKS, PyList_New(0)) < 0 || keep_slots(seq, NULL, 0) < 0)
        return -1;
    return 0;
}

static PyObject *
release_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "release_blocks(kv, seq)");
        return NULL;
    }
    if (ensure_ready() < 0 || release(args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* kv.allocate_unique(n): a new list of ids, Py_None (new ref) when there is no room. */
static PyObject *
allocate_unique(PyObject *kv, Py_ssize_t n)
{
    if (n >= 0 && kv_native(kv))
        return kv_api->allocate_unique(kv, n);
    PyObject *count = PyLong_FromSsize_t(n);
    if (count == NULL)
        return NULL;
    PyObject *argv[2] = {kv, count};
    PyObject *r = PyObject_VectorcallMethod(s_allocate_unique, argv,
                                            2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(count);
    return r;
}

/* Append the items of ``items`` to the list field ``f`` (list.extend). */
static int
extend_field(PyObject *seq, int f, PyObject *items)
{
    PyObject *list = get(seq, f);
    if (list == NULL)
        return -1;
    int rc;
    if (PyList_CheckExact(list) && PyList_CheckExact(items) && PyList_GET_SIZE(items) == 1) {
        rc = PyList_Append(list, PyList_GET_ITEM(items, 0)); /* a decode's one new block */
    } else if (PyList_Check(list)) {
        Py_ssize_t end = PyList_GET_SIZE(list);
        rc = PyList_SetSlice(list, end, end, items);
    } else {
        PyObject *r = PyObject_CallMethod(list, "extend", "O", items);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(list);
    return rc;
}

/* Room for the token a decode computes (a new tail block at a block boundary): 1, 0 (no
 * room, nothing changed), -1. */
static int
grow(PyObject *kv, PyObject *seq, Py_ssize_t bs)
{
    Py_ssize_t ntok = num_tokens(seq), nfull = len_of(seq, F_FULL_BLOCKS);
    Py_ssize_t nuniq = len_of(seq, F_UNIQUE_BLOCKS);
    if (ntok < 0 || nfull < 0 || nuniq < 0)
        return -1;
    Py_ssize_t missing = ceil_div(ntok, bs) - nfull - nuniq;
    if (missing <= 0)
        return 1;
    PyObject *ids = allocate_unique(kv, missing);
    if (ids == NULL)
        return -1;
    if (ids == Py_None) {
        Py_DECREF(ids);
        return 0;
    }
    int rc = extend_field(seq, F_UNIQUE_BLOCKS, ids);
    Py_DECREF(ids);
    return rc < 0 ? -1 : 1;
}

static int promote_direct(PyObject *kv, PyObject *seq, PyObject *chain, PyObject *locals,
                          PyObject *unique, Py_ssize_t k, Py_ssize_t n);

/* Private tail blocks whose KV is complete become shareable full blocks (kv.promote_run). */
static int
promote_filled(PyObject *kv, PyObject *seq, Py_ssize_t bs, Py_ssize_t computed, Py_ssize_t k,
               Py_ssize_t nuniq)
{
    Py_ssize_t n = computed / bs - k;
    if (n > nuniq)
        n = nuniq;
    if (n <= 0)
        return 0;
    int rc = -1;
    PyObject *chain = get(seq, F_BLOCK_HASHES), *locals = NULL, *unique = NULL, *ids = NULL,
             *hashes = NULL, *local = NULL, *parent = NULL, *r = NULL;
    if (chain == NULL || (locals = get(seq, F_LOCAL_HASHES)) == NULL ||
        (unique = get(seq, F_UNIQUE_BLOCKS)) == NULL)
        goto done;
    if (kv_native(kv) && PyList_CheckExact(chain) && PyList_CheckExact(locals) &&
        PyList_CheckExact(unique) && PyList_GET_SIZE(chain) >= k + n &&
        PyList_GET_SIZE(locals) >= k + n && PyList_GET_SIZE(unique) >= n) {
        rc = promote_direct(kv, seq, chain, locals, unique, k, n);
        goto done;
    }
    if ((hashes = PySequence_GetSlice(chain, k, k + n)) == NULL ||
        (local = PySequence_GetSlice(locals, k, k + n)) == NULL ||
        (ids = PySequence_GetSlice(unique, 0, n)) == NULL)
        goto done;
    parent = k ? PySequence_GetItem(chain, k - 1) : Py_NewRef(Py_None);
    if (parent == NULL)
        goto done;
    PyObject *argv[5] = {kv, ids, hashes, local, parent};
    r = PyObject_VectorcallMethod(s_promote_run, argv, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL || PySequence_DelSlice(unique, 0, n) < 0 ||
        extend_field(seq, F_FULL_BLOCKS, hashes) < 0 || keep_slots(seq, NULL, 0) < 0)
        goto done;
    rc = 0;
done:
    Py_XDECREF(chain);
    Py_XDECREF(locals);
    Py_XDECREF(unique);
    Py_XDECREF(ids);
    Py_XDECREF(hashes);
    Py_XDECREF(local);
    Py_XDECREF(parent);
    Py_XDECREF(r);
    return rc;
}

/* promote_filled with the native KV manager and lists long enough (checked): its call on the
 * lists' items (no slice of each, no method call), then the same changes to the lists. */
static int
promote_direct(PyObject *kv, PyObject *seq, PyObject *chain, PyObject *locals, PyObject *unique,
               Py_ssize_t k, Py_ssize_t n)
{
    PyObject *parent = k ? PyList_GET_ITEM(chain, k - 1) : Py_None;
    enum { ON_STACK = 32 };
    int32_t stack[ON_STACK], *slots = stack; /* the promoted blocks' slots */
    if (n > ON_STACK && (slots = PyMem_Malloc((size_t)n * sizeof(int32_t))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = 0;
    if (kv_api->promote_run(kv, PySequence_Fast_ITEMS(unique), PySequence_Fast_ITEMS(chain) + k,
                            PySequence_Fast_ITEMS(locals) + k, n, parent, slots) < 0 ||
        PyList_SetSlice(unique, 0, n, NULL) < 0)
        rc = -1;
    else
        rc = extend_slots(seq, k, slots, n); /* before ``full`` grows: it checks k */
    if (slots != stack)
        PyMem_Free(slots);
    if (rc < 0)
        return -1;
    PyObject *full = get(seq, F_FULL_BLOCKS);
    if (full == NULL)
        return -1;
    if (PyList_CheckExact(full)) {
        /* by index: ``full`` may be the chain itself, which the appends grow */
        for (Py_ssize_t i = 0; i < n && rc == 0; i++)
            rc = PyList_Append(full, PyList_GET_ITEM(chain, k + i));
    } else {
        PyObject *hashes = PyList_GetSlice(chain, k, k + n);
        rc = hashes == NULL ? -1 : extend_field(seq, F_FULL_BLOCKS, hashes);
        Py_XDECREF(hashes);
    }
    Py_DECREF(full);
    return rc;
}

/* -- schedule_pass -------------------------------------------------------------------------- */

typedef struct {
    PyObject **seq; /* strong references */
    Py_ssize_t *n;  /* -1: removed (its sequence was preempted) */
    Py_ssize_t *ctx; /* a decode's tokens (its context), -1 for a prefill chunk: the batch's
                      * figures without reading the sequence again (nothing changes it between
                      * its planning and the count, but a preemption, which removes it) */
    Py_ssize_t *ntok, *computed; /* its tokens and computed tokens as planned (the same) */
    Py_ssize_t len, cap;
    int heap; /* the arrays are a heap block (else ``first``) */
    /* the caller's room for the first PLAN_FIRST entries' arrays (on its stack: a pass of the
     * replay runs ~8 sequences, so no allocation and free a pass), or NULL */
    Py_ssize_t *first;
} Plan;

#define PLAN_FIRST 16

/* The plan's five arrays in one block (``seq``'s start): ``first`` for the first PLAN_FIRST
 * entries, then a heap block doubled when full. 0, or -1 with MemoryError (nothing changed). */
static int
plan_grow(Plan *p)
{
    const size_t entry = sizeof(PyObject *) + 4 * sizeof(Py_ssize_t);
    Py_ssize_t cap = p->cap ? 2 * p->cap : PLAN_FIRST;
    if ((size_t)cap > PY_SSIZE_T_MAX / entry) {
        PyErr_NoMemory();
        return -1;
    }
    _Static_assert(sizeof(PyObject *) == sizeof(Py_ssize_t), "an entry is five words");
    PyObject **seq = p->cap == 0 && p->first != NULL ? (PyObject **)p->first
                                                      : PyMem_Malloc((size_t)cap * entry);
    if (seq == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t *n = (Py_ssize_t *)(seq + cap), *ctx = n + cap, *ntok = ctx + cap,
               *computed = ntok + cap;
    if (p->len > 0) {
        size_t len = (size_t)p->len;
        memcpy(seq, p->seq, len * sizeof *seq);
        memcpy(n, p->n, len * sizeof *n);
        memcpy(ctx, p->ctx, len * sizeof *ctx);
        memcpy(ntok, p->ntok, len * sizeof *ntok);
        memcpy(computed, p->computed, len * sizeof *computed);
    }
    if (p->heap)
        PyMem_Free(p->seq);
    p->heap = (void *)seq != (void *)p->first;
    p->seq = seq, p->n = n, p->ctx = ctx, p->ntok = ntok, p->computed = computed;
    p->cap = cap;
    return 0;
}

static int
plan_add(Plan *p, PyObject *seq, Py_ssize_t n, Py_ssize_t ctx, Py_ssize_t ntok,
         Py_ssize_t computed)
{
    if (p->len == p->cap && plan_grow(p) < 0)
        return -1;
    p->seq[p->len] = Py_NewRef(seq);
    p->ctx[p->len] = ctx;
    p->ntok[p->len] = ntok;
    p->computed[p->len] = computed;
    p->n[p->len++] = n;
    return 0;
}

/* Drop ``seq``'s entry; the tokens it had (0 if none). */
static Py_ssize_t
plan_remove(Plan *p, PyObject *seq)
{
    for (Py_ssize_t i = 0; i < p->len; i++) {
        if (p->seq[i] == seq && p->n[i] >= 0) {
            Py_ssize_t n = p->n[i];
            p->n[i] = -1;
            return n;
        }
    }
    return 0;
}

static void
plan_free(Plan *p)
{
    for (Py_ssize_t i = 0; i < p->len; i++)
        Py_DECREF(p->seq[i]);
    if (p->heap)
        PyMem_Free(p->seq); /* the block of all five (plan_grow) */
}

typedef struct {
    PyObject *running, *waiting, *kv, *transfer, *now_obj;
    double now;
    Py_ssize_t budget, bs, max_batched, max_seqs;
    int lifo, chunked, caching;
    Plan plan;
    PyObject *preempted;
} Pass;

/* Preempt the running sequence at ``index``: blocks released (they stay cached), progress
 * reset, requeued at the front of the waiting queue. */
static int
preempt(Pass *ps, Py_ssize_t index, PyObject *victim)
{
    Py_ssize_t preemptions;
    if (PyList_SetSlice(ps->running, index, index + 1, NULL) < 0 || release(ps->kv, victim) < 0)
        return -1;
    if (put_ssize(victim, F_NUM_COMPUTED_TOKENS, 0) < 0 ||
        put_ssize(victim, F_PREFILL_END, 0) < 0 ||
        get_ssize(victim, F_NUM_PREEMPTIONS, &preemptions) < 0 ||
        put_ssize(victim, F_NUM_PREEMPTIONS, preemptions + 1) < 0 ||
        put(victim, F_STATUS, st_waiting) < 0)
        return -1;
    PyObject *argv[2] = {ps->waiting, victim};
    PyObject *r =
        PyObject_VectorcallMethod(s_appendleft, argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return PyList_Append(ps->preempted, victim);
}

/* Schedule ``seq``, of ``ntok`` tokens of which ``computed`` are, for the rest, capped by the
 * budget. */
static int
schedule_known(Pass *ps, PyObject *seq, Py_ssize_t ntok, Py_ssize_t computed,
               Py_ssize_t prefill_end)
{
    Py_ssize_t n = ntok - computed, ctx = computed >= prefill_end ? ntok : -1;
    if (n > ps->budget)
        n = ps->budget;
    if (plan_add(&ps->plan, seq, n, ctx, ntok, computed) < 0)
        return -1;
    ps->budget -= n;
    return 0;
}

/* Schedule ``seq`` for its uncomputed tokens, capped by the budget. */
static int
schedule_rest(Pass *ps, PyObject *seq)
{
    Py_ssize_t ntok = num_tokens(seq), computed, prefill_end;
    if (ntok < 0 || get_ssize(seq, F_NUM_COMPUTED_TOKENS, &computed) < 0 ||
        get_ssize(seq, F_PREFILL_END, &prefill_end) < 0)
        return -1;
    return schedule_known(ps, seq, ntok, computed, prefill_end);
}

/* One running sequence, ``running[*i]`` on entry; *i is the next index on return. */
static int
plan_one(Pass *ps, PyObject *seq, Py_ssize_t *i)
{
    int pending = get_bool(seq, F_PENDING_TRANSFER);
    if (pending < 0)
        return -1;
    if (pending) {
        PyObject *ready = get(seq, F_READY_AT);
        if (ready == NULL)
            return -1;
        double at = PyFloat_AsDouble(ready);
        Py_DECREF(ready);
        if (at == -1.0 && PyErr_Occurred())
            return -1;
        if (at > ps->now) { /* its KV transfer has not landed yet */
            (*i)++;
            return 0;
        }
        if (put(seq, F_PENDING_TRANSFER, Py_False) < 0)
            return -1;
    }
    (*i)++;
    Py_ssize_t ntok = num_tokens(seq), computed, prefill_end;
    if (ntok < 0 || get_ssize(seq, F_NUM_COMPUTED_TOKENS, &computed) < 0 ||
        get_ssize(seq, F_PREFILL_END, &prefill_end) < 0)
        return -1;
    if (computed >= prefill_end) {
        Py_ssize_t nfull = len_of(seq, F_FULL_BLOCKS), nuniq = len_of(seq, F_UNIQUE_BLOCKS);
        if (nfull < 0 || nuniq < 0)
            return -1;
        if (ntok > ps->bs * (nfull + nuniq)) {
            /* a decode whose token starts a new block: grow it, preempting if it must */
            for (;;) {
                int g = grow(ps->kv, seq, ps->bs);
                if (g < 0)
                    return -1;
                if (g)
                    break;
                Py_ssize_t count = PyList_GET_SIZE(ps->running);
                if (count == 0) { /* seq itself is running: only a broken caller gets here */
                    PyErr_SetString(PyExc_RuntimeError, "a running sequence is not in running");
                    return -1;
                }
                Py_ssize_t vi = ps->lifo ? count - 1 : 0;
                PyObject *victim = Py_NewRef(PyList_GET_ITEM(ps->running, vi));
                if (vi < *i)
                    (*i)--;
                ps->budget += plan_remove(&ps->plan, victim);
                int rc = preempt(ps, vi, victim);
                Py_DECREF(victim);
                if (rc < 0)
                    return -1;
                if (victim == seq)
                    break;
            }
            int still = status_is(seq, st_running);
            if (still <= 0)
                return still;
        }
    }
    return schedule_known(ps, seq, ntok, computed, prefill_end); /* growing changed none */
}

/* Admit ``seq``: its cached prefix found and blocks taken for all its tokens. 1: admitted;
 * 0: it cannot start now (nothing changed); -1: error. */
static int
allocate(Pass *ps, PyObject *seq)
{
    Py_ssize_t bs = ps->bs, ntok = num_tokens(seq), computed;
    if (ntok < 0)
        return -1;
    int pending = get_bool(seq, F_PENDING_TRANSFER);
    if (pending < 0)
        return -1;
    PyObject *chain = get(seq, F_BLOCK_HASHES);
    if (chain == NULL)
        return -1;
    int rc = -1;
    PyObject *locals = NULL, *full = NULL, *local = NULL, *r = NULL, *unique = NULL;
    /* The native KV manager and a list: the chain's keys converted once for its three calls
     * (_kv_api.h), not once a method call. */
    int direct = kv_native(ps->kv) && PyList_CheckExact(chain);
    Py_ssize_t nchain = direct ? PyList_GET_SIZE(chain) : 0;
    uint64_t *keys = NULL;
    int32_t *slots = NULL; /* each key's table slot, looked up once for the three calls */
    int kept = 0;          /* slots[:len(full)] are the full blocks' after use() */
    uint8_t *negs = NULL, *ok = NULL;
    if (direct) {
        Py_ssize_t cap = nchain ? nchain : 1;
        keys = PyMem_Malloc((size_t)cap * (sizeof(uint64_t) + sizeof(int32_t) + 2));
        if (keys == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        slots = (int32_t *)(keys + cap);
        negs = (uint8_t *)(slots + cap);
        ok = negs + cap;
        for (Py_ssize_t i = 0; i < nchain; i++)
            slots[i] = DYN_KV_SLOT_UNKNOWN;
        kv_api->keys_of(PySequence_Fast_ITEMS(chain), nchain, keys, negs, ok);
    }
    if (pending) {
        computed = ntok - 1; /* KV arrives from the prefill worker; recompute the last one */
    } else {
        int reuse = get_bool(seq, F_REUSE_PREFIX_CACHE);
        if (reuse < 0)
            goto done;
        Py_ssize_t hit = 0;
        if (reuse && direct) {
            hit = kv_api->cached_prefix(ps->kv, keys, ok, slots, nchain);
        } else if (reuse) {
            PyObject *argv[2] = {ps->kv, chain};
            hit = as_ssize(PyObject_VectorcallMethod(s_num_cached_prefix, argv,
                                                     2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL));
            if (hit == -1 && PyErr_Occurred())
                goto done;
        }
        computed = hit * bs;
        if (computed > ntok - 1)
            computed = ntok - 1; /* like vLLM, always compute >= 1 token */
    }
    Py_ssize_t new_tokens = ntok - computed;
    if (!ps->chunked && ps->budget < new_tokens && new_tokens <= ps->max_batched) {
        rc = 0; /* wait for a pass with room (larger ones are chunked anyway) */
        goto done;
    }
    Py_ssize_t n_full = !ps->caching ? 0 : pending ? ntok / bs : ceil_div(computed, bs);
    Py_ssize_t n_unique = ceil_div(ntok, bs) - n_full;
    if ((locals = get(seq, F_LOCAL_HASHES)) == NULL ||
        (full = PySequence_GetSlice(chain, 0, n_full)) == NULL)
        goto done;
    if (direct && PyList_CheckExact(locals)) {
        /* use() takes the local hashes as they are: locals[:n_full], no slice */
    } else if ((local = PySequence_GetSlice(locals, 0, n_full)) == NULL) {
        goto done;
    }
    Py_ssize_t needed;
    if (direct) { /* ``full`` is chain[:n_full]: its keys lead the chain's */
        needed = kv_api->slots_missing(ps->kv, keys, ok, slots, PyList_GET_SIZE(full)) +
                 n_unique;
    } else {
        PyObject *count = PyLong_FromSsize_t(n_unique);
        if (count == NULL)
            goto done;
        PyObject *argv[3] = {ps->kv, full, count};
        needed = as_ssize(PyObject_VectorcallMethod(s_num_slots_needed, argv,
                                                    3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL));
        Py_DECREF(count);
        if (needed == -1 && PyErr_Occurred())
            goto done;
    }
    Py_ssize_t available =
        direct ? kv_api->available(ps->kv)
               : as_ssize(PyObject_GetAttr(ps->kv, s_num_available_blocks));
    if (available == -1 && PyErr_Occurred())
        goto done;
    if (needed > available) {
        rc = 0;
        goto done;
    }
    if (PyList_Check(full) ? PyList_GET_SIZE(full) > 0 : PyObject_IsTrue(full) == 1) {
        /* Blocks received from a prefill worker are not announced: routers only index what
         * this worker computed (the prefill worker owns the prompt's KV, FACTS §9.1). */
        if (local == NULL) { /* direct, with the local hashes' list as it is */
            Py_ssize_t nf = PyList_GET_SIZE(full);
            if (PyList_GET_SIZE(locals) < nf) {
                PyErr_SetString(PyExc_IndexError, "local_hashes is shorter than block_hashes");
                goto done;
            }
            if (kv_api->use(ps->kv, PySequence_Fast_ITEMS(chain), PySequence_Fast_ITEMS(locals),
                            keys, negs, ok, slots, nf, !pending) < 0)
                goto done;
            kept = 1;
        } else {
            PyObject *uargv[4] = {ps->kv, full, local, pending ? Py_False : Py_True};
            r = PyObject_VectorcallMethod(s_use, uargv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                          s_announce_kw);
            if (r == NULL)
                goto done;
        }
    }
    if ((unique = allocate_unique(ps->kv, n_unique)) == NULL)
        goto done;
    if (unique == Py_None) { /* room was checked above */
        PyErr_SetString(PyExc_AssertionError, "no room for the private blocks checked for");
        goto done;
    }
    /* the full blocks' slots, as use() found or stored them, kept for the release */
    if (put(seq, F_FULL_BLOCKS, full) < 0 || put(seq, F_UNIQUE_BLOCKS, unique) < 0 ||
        keep_slots(seq, kept ? slots : NULL, kept ? PyList_GET_SIZE(full) : 0) < 0 ||
        put_ssize(seq, F_NUM_COMPUTED_TOKENS, computed) < 0 ||
        put_ssize(seq, F_PREFILL_END, pending ? computed : ntok) < 0)
        goto done;
    PyObject *cached = get(seq, F_NUM_CACHED_TOKENS);
    if (cached == NULL)
        goto done;
    Py_DECREF(cached);
    if (cached == Py_None) {
        /* A received prompt reports the prefill worker's prefix hit as its cached tokens. */
        PyObject *handoff = get(seq, F_HANDOFF), *value;
        if (handoff == NULL)
            goto done;
        int has = pending ? PyObject_IsTrue(handoff) : 0;
        if (has < 0) {
            Py_DECREF(handoff);
            goto done;
        }
        value = has ? PyObject_GetAttr(handoff, s_num_cached_tokens) : count_int(computed);
        Py_DECREF(handoff);
        if (put_new(seq, F_NUM_CACHED_TOKENS, value) < 0)
            goto done;
    }
    if (put(seq, F_STATUS, st_running) < 0)
        goto done;
    rc = 1;
done:
    PyMem_Free(keys);
    Py_DECREF(chain);
    Py_XDECREF(locals);
    Py_XDECREF(full);
    Py_XDECREF(local);
    Py_XDECREF(r);
    Py_XDECREF(unique);
    return rc;
}

/* Admit waiting sequences in FIFO order while budget and max_num_seqs allow. */
static int
admit_waiting(Pass *ps)
{
    for (;;) {
        Py_ssize_t nwait = PyObject_Length(ps->waiting);
        if (nwait < 0)
            return -1;
        if (nwait == 0 || ps->budget <= 0 || PyList_GET_SIZE(ps->running) >= ps->max_seqs)
            return 0;
        PyObject *seq = PySequence_GetItem(ps->waiting, 0);
        if (seq == NULL)
            return -1;
        int rc = allocate(ps, seq);
        if (rc <= 0) { /* head-of-line: later requests wait behind it (FIFO) */
            Py_DECREF(seq);
            return rc;
        }
        PyObject *argv[1] = {ps->waiting};
        PyObject *r =
            PyObject_VectorcallMethod(s_popleft, argv, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(r);
        if (r == NULL || PyList_Append(ps->running, seq) < 0)
            goto fail;
        int pending = get_bool(seq, F_PENDING_TRANSFER);
        if (pending < 0)
            goto fail;
        if (pending) {
            PyObject *prompt = get(seq, F_NUM_PROMPT_TOKENS);
            PyObject *wait = prompt ? PyObject_CallOneArg(ps->transfer, prompt) : NULL;
            Py_XDECREF(prompt);
            PyObject *ready = wait ? PyNumber_Add(ps->now_obj, wait) : NULL;
            Py_XDECREF(wait);
            if (ready == NULL)
                goto fail;
            int later = PyObject_RichCompareBool(ready, ps->now_obj, Py_GT);
            if (later < 0 || put_new(seq, F_READY_AT, ready) < 0)
                goto fail;
            if (later) {
                Py_DECREF(seq);
                continue;
            }
            if (put(seq, F_PENDING_TRANSFER, Py_False) < 0)
                goto fail;
        }
        rc = schedule_rest(ps, seq);
        Py_DECREF(seq);
        if (rc < 0)
            return -1;
        continue;
    fail:
        Py_DECREF(seq);
        return -1;
    }
}

/* A tuple of ``items`` (borrowed objects, or NULL: the next of the ``ints``): built directly,
 * as ``Py_BuildValue`` parses its format for every tuple (~5x the work, once per batch entry). */
static PyObject *
tuple_of(Py_ssize_t n, PyObject *const *items, const Py_ssize_t *ints)
{
    PyObject *t = PyTuple_New(n);
    if (t == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = items[i] ? Py_NewRef(items[i]) : count_int(*ints++);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

/* The last config whose limits were read, when it is a frozen dataclass (the mocker's
 * ``MockerConfig``, shared by its ranks): held, so its identity says its values, which are then
 * not read again every pass (six attribute lookups). Any other config is read every pass. */
static PyObject *limits_of;
static Py_ssize_t limits_batched, limits_bs, limits_seqs;
static int limits_chunked, limits_caching, limits_lifo;

/* The pass's limits from ``config`` into ``ps``: 0, or -1 with the error. */
static int
read_limits(PyObject *config, Pass *ps)
{
    if (config == limits_of) {
        ps->max_batched = limits_batched, ps->bs = limits_bs, ps->max_seqs = limits_seqs;
        ps->chunked = limits_chunked, ps->caching = limits_caching, ps->lifo = limits_lifo;
        return 0;
    }
    if (config_ssize(config, s_max_num_batched_tokens, &ps->max_batched) < 0 ||
        config_ssize(config, s_block_size, &ps->bs) < 0 ||
        config_ssize(config, s_max_num_seqs, &ps->max_seqs) < 0 ||
        (ps->chunked = config_bool(config, s_enable_chunked_prefill)) < 0 ||
        (ps->caching = config_bool(config, s_enable_prefix_caching)) < 0)
        return -1;
    if (ps->bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return -1;
    }
    PyObject *mode = PyObject_GetAttr(config, s_preemption_mode);
    if (mode == NULL)
        return -1;
    ps->lifo = PyUnicode_Check(mode) && PyUnicode_CompareWithASCIIString(mode, "lifo") == 0;
    Py_DECREF(mode);
    if (dyn_frozen_dataclass(config)) {
        Py_XSETREF(limits_of, Py_NewRef(config));
        limits_batched = ps->max_batched, limits_bs = ps->bs, limits_seqs = ps->max_seqs;
        limits_chunked = ps->chunked, limits_caching = ps->caching, limits_lifo = ps->lifo;
    }
    return 0;
}

/* Plan the pass: ``ps`` gets its batch (``ps->plan``, only the entries that run, in order)
 * and its preempted list; ``figures``: (num_prefill_tokens, num_decodes,
 * decode_context_tokens). -1 on error. The caller frees ``ps->plan`` and ``ps->preempted``
 * (``ps`` zeroed before the call). ``args``: schedule_pass's six. */
static int
schedule_into(PyObject *const *args, Pass *ps, Py_ssize_t figures[3])
{
    if (ensure_ready() < 0)
        return -1;
    ps->running = args[0], ps->waiting = args[1], ps->kv = args[2], ps->now_obj = args[4];
    ps->transfer = args[5];
    PyObject *config = args[3];
    if (!PyList_Check(ps->running)) {
        PyErr_SetString(PyExc_TypeError, "running must be a list");
        return -1;
    }
    ps->now = PyFloat_AsDouble(ps->now_obj);
    if (ps->now == -1.0 && PyErr_Occurred())
        return -1;
    if (read_limits(config, ps) < 0)
        return -1;
    ps->budget = ps->max_batched;
    if ((ps->preempted = PyList_New(0)) == NULL)
        return -1;
    Py_ssize_t i = 0;
    while (i < PyList_GET_SIZE(ps->running) && ps->budget > 0) {
        PyObject *seq = Py_NewRef(PyList_GET_ITEM(ps->running, i));
        int rc = plan_one(ps, seq, &i);
        Py_DECREF(seq);
        if (rc < 0)
            return -1;
    }
    if (PyList_GET_SIZE(ps->preempted) == 0 && admit_waiting(ps) < 0)
        return -1;
    Py_ssize_t prefill = 0, decodes = 0, context = 0, kept = 0;
    Plan *p = &ps->plan;
    for (Py_ssize_t k = 0; k < p->len; k++) {
        Py_ssize_t n = p->n[k], ctx = p->ctx[k];
        PyObject *seq = p->seq[k];
        p->seq[k] = NULL;
        if (n < 0) { /* preempted after it was planned: out of the batch */
            Py_DECREF(seq);
            continue;
        }
        p->seq[kept] = seq;
        p->ctx[kept] = ctx;
        p->ntok[kept] = p->ntok[k];
        p->computed[kept] = p->computed[k];
        p->n[kept++] = n;
        if (ctx >= 0) {
            decodes++;
            context += ctx;
        } else {
            prefill += n;
        }
    }
    p->len = kept;
    figures[0] = prefill, figures[1] = decodes, figures[2] = context;
    return 0;
}

/* schedule_pass(running, waiting, kv, config, now, transfer_seconds): see _pass.pyi. */
static PyObject *
schedule_pass(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "schedule_pass(running, waiting, kv, config, now, transfer_seconds)");
        return NULL;
    }
    Pass ps = {0};
    Py_ssize_t first[PLAN_FIRST * 5]; /* the plan's first arrays (plan_grow) */
    ps.plan.first = first;
    Py_ssize_t figures[3];
    PyObject *entries = NULL, *result = NULL;
    if (schedule_into(args, &ps, figures) < 0 || (entries = PyList_New(ps.plan.len)) == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < ps.plan.len; k++) {
        PyObject *items[2] = {ps.plan.seq[k], NULL};
        PyObject *entry = tuple_of(2, items, &ps.plan.n[k]);
        if (entry == NULL)
            goto done;
        PyList_SET_ITEM(entries, k, entry);
    }
    PyObject *items[5] = {entries, ps.preempted, NULL, NULL, NULL};
    result = tuple_of(5, items, figures);
done:
    plan_free(&ps.plan);
    Py_XDECREF(ps.preempted);
    Py_XDECREF(entries);
    return result;
}

/* -- update_pass ---------------------------------------------------------------------------- */

/* xxh3(bytes, seed) through xxhash.xxh3_64_intdigest (router.hashing's block hash). */
static PyObject *
call_hash(const char *data, Py_ssize_t len, PyObject *seed)
{
    PyObject *bytes = PyBytes_FromStringAndSize(data, len);
    if (bytes == NULL)
        return NULL;
    PyObject *argv[2] = {bytes, seed};
    PyObject *h = PyObject_Vectorcall(hash_fn, argv, 2, NULL);
    Py_DECREF(bytes);
    return h;
}

static void
put_u64_le(unsigned char *p, uint64_t v)
{
    for (int k = 0; k < 8; k++)
        p[k] = (unsigned char)(v >> (8 * k));
}

/* Sequence.append_token: append to ``output`` (the sequence's, after a prompt of ``nprompt``
 * ids), and hash the block the token completes (if it does: its ids are read from the output,
 * and from the prompt where the block starts in it). */
static int
append_token(PyObject *seq, PyObject *output, Py_ssize_t nprompt, PyObject *token,
             Py_ssize_t block_size)
{
    if (PyList_Append(output, token) < 0)
        return -1;
    Py_ssize_t len = nprompt + PyList_GET_SIZE(output), start = len - block_size;
    if (len % block_size != 0)
        return 0;
    int rc = -1;
    PyObject *seed = NULL, *local = NULL, *locals = NULL, *chain = NULL, *next = NULL;
    PyObject *prompt = NULL;
    unsigned char *buf = NULL;
    Py_buffer packed; /* a packed prompt's ids (an array('I'), the offline replay's) */
    packed.obj = NULL;
    if (start < nprompt) {
        if ((prompt = get(seq, F_PROMPT)) == NULL)
            return -1;
        if (!PyList_Check(prompt)) {
            if (!PyObject_CheckBuffer(prompt) ||
                PyObject_GetBuffer(prompt, &packed, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
                PyErr_Clear();
            else if (packed.itemsize != 4 || packed.format == NULL ||
                     strcmp(packed.format, "I") != 0)
                PyBuffer_Release(&packed);
        }
        if (packed.obj != NULL ? packed.len / 4 < nprompt
                               : !PyList_Check(prompt) || PyList_GET_SIZE(prompt) < nprompt) {
            PyErr_SetString(PyExc_TypeError, "prompt must be a list of num_prompt_tokens ids");
            goto done;
        }
    }
    unsigned char stack[256]; /* a block of up to 64 ids: no allocation */
    buf = (size_t)block_size * 4 <= sizeof stack ? stack : PyMem_Malloc((size_t)block_size * 4);
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < block_size; k++) {
        Py_ssize_t at = start + k;
        if (at < nprompt && packed.obj != NULL) {
            const unsigned char *p = (const unsigned char *)packed.buf + 4 * at;
            uint32_t u;
            memcpy(&u, p, 4);
            for (int b = 0; b < 4; b++)
                buf[4 * k + b] = (unsigned char)(u >> (8 * b));
            continue;
        }
        PyObject *id = at < nprompt ? PyList_GET_ITEM(prompt, at)
                                    : PyList_GET_ITEM(output, at - nprompt);
        /* array('I', ...) semantics: an id outside [0, 2**32) is an OverflowError (an exact
         * int of at most one digit, every vocabulary's id, is read from it) */
        unsigned long t;
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
        if (PyLong_CheckExact(id) && (Py_SIZE(id) == 0 || Py_SIZE(id) == 1))
            t = Py_SIZE(id) == 0 ? 0 : ((PyLongObject *)id)->ob_digit[0];
        else
#endif
            if ((t = PyLong_AsUnsignedLong(id)) == (unsigned long)-1 && PyErr_Occurred())
            goto done;
        if (t > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_OverflowError, "token id does not fit in 32 bits");
            goto done;
        }
        for (int b = 0; b < 4; b++)
            buf[4 * k + b] = (unsigned char)(t >> (8 * b));
    }
    /* the block's hash in C when its seed is an exact int in [0, 2**64) (block_seed's are);
     * any other seed goes to xxhash's function, which decides what it accepts */
    uint64_t seed_u, local_u = 0;
    PyObject *seed_v = peek(seq, F_HASH_SEED);
    int direct = seed_v != NULL && dyn_u64_digits(seed_v, &seed_u);
    if (direct) {
        local_u = XXH3_64bits_withSeed(buf, (size_t)block_size * 4, seed_u);
        if ((local = PyLong_FromUnsignedLongLong(local_u)) == NULL)
            goto done;
    } else if ((seed = get(seq, F_HASH_SEED)) == NULL ||
               (local = call_hash((const char *)buf, block_size * 4, seed)) == NULL) {
        goto done;
    }
    if ((locals = get(seq, F_LOCAL_HASHES)) == NULL)
        goto done;
    if ((chain = get(seq, F_BLOCK_HASHES)) == NULL)
        goto done;
    if (!PyList_Check(locals) || !PyList_Check(chain)) {
        PyErr_SetString(PyExc_TypeError, "local_hashes and block_hashes must be lists");
        goto done;
    }
    if (PyList_Append(locals, local) < 0)
        goto done;
    Py_ssize_t depth = PyList_GET_SIZE(chain);
    if (depth == 0) {
        next = Py_NewRef(local);
    } else {
        unsigned char pair[16];
        PyObject *last = PyList_GET_ITEM(chain, depth - 1);
        uint64_t parent, lo = local_u;
        if (!dyn_u64_digits(last, &parent) &&
            (parent = DYN_AS_U64(last)) == (uint64_t)-1 && PyErr_Occurred())
            goto done;
        if (!direct && (lo = DYN_AS_U64(local)) == (uint64_t)-1 && PyErr_Occurred())
            goto done;
        put_u64_le(pair, parent);
        put_u64_le(pair + 8, lo);
        /* next_sequence_hash: XXH3 of the pair with the chain's seed, in C */
        if ((next = PyLong_FromUnsignedLongLong(
                 XXH3_64bits_withSeed(pair, sizeof pair, SEQUENCE_SEED))) == NULL)
            goto done;
    }
    rc = PyList_Append(chain, next);
done:
    if (buf != stack)
        PyMem_Free(buf);
    if (packed.obj != NULL)
        PyBuffer_Release(&packed);
    Py_XDECREF(prompt);
    Py_XDECREF(seed);
    Py_XDECREF(local);
    Py_XDECREF(locals);
    Py_XDECREF(chain);
    Py_XDECREF(next);
    return rc;
}

/* Sequence.finish_after: the reason (borrowed: length or stop) or NULL to go on; -1 on error. */
static int
finish_reason(PyObject *seq, Py_ssize_t n, PyObject *token, PyObject **reason)
{
    Py_ssize_t max_tokens, min_tokens; /* n: the output's tokens (num_output_tokens) */
    *reason = NULL;
    if (get_ssize(seq, F_MAX_TOKENS, &max_tokens) < 0)
        return -1;
    if (n >= max_tokens) {
        *reason = fr_length;
        return 0;
    }
    if (get_ssize(seq, F_MIN_TOKENS, &min_tokens) < 0)
        return -1;
    if (n < min_tokens)
        return 0;
    PyObject *stops = get(seq, F_STOP_TOKEN_IDS);
    if (stops == NULL)
        return -1;
    /* a set's membership directly (most have none: no lookup at all) */
    int hit = !PyAnySet_CheckExact(stops)      ? PySequence_Contains(stops, token)
              : PySet_GET_SIZE(stops) == 0 ? 0
                                           : PySet_Contains(stops, token);
    Py_DECREF(stops);
    if (hit < 0)
        return -1;
    if (hit)
        *reason = fr_stop;
    return 0;
}

/* Advance one entry; appends to tokens_out / finished when it samples / ends. */
static int
advance_one(PyObject *kv, PyObject *seq, Py_ssize_t n, PyObject *token, Py_ssize_t bs,
            int caching, PyObject *tokens_out, PyObject *finished, Py_ssize_t ntok,
            Py_ssize_t computed)
{
    /* ntok, computed: as planned, or -1 (read them) */
    int alive = status_is(seq, st_running);
    if (alive <= 0)
        return alive; /* aborted while the pass ran */
    if (computed < 0 && get_ssize(seq, F_NUM_COMPUTED_TOKENS, &computed) < 0)
        return -1;
    computed += n;
    if (put_ssize(seq, F_NUM_COMPUTED_TOKENS, computed) < 0)
        return -1;
    if (caching) {
        Py_ssize_t nuniq = len_of(seq, F_UNIQUE_BLOCKS);
        if (nuniq < 0)
            return -1;
        if (nuniq > 0) {
            Py_ssize_t nfull = len_of(seq, F_FULL_BLOCKS);
            if (nfull < 0)
                return -1;
            if (computed >= (nfull + 1) * bs && promote_filled(kv, seq, bs, computed, nfull, nuniq) < 0)
                return -1;
        }
    }
    PyObject *output = get(seq, F_OUTPUT);
    if (output == NULL)
        return -1;
    if (!PyList_Check(output)) {
        Py_DECREF(output);
        PyErr_SetString(PyExc_TypeError, "output must be a list");
        return -1;
    }
    Py_ssize_t nprompt = ntok - PyList_GET_SIZE(output);
    if (ntok < 0 && get_ssize(seq, F_NUM_PROMPT_TOKENS, &nprompt) < 0) {
        Py_DECREF(output);
        return -1;
    }
    if (computed < nprompt + PyList_GET_SIZE(output)) {
        Py_DECREF(output);
        return 0; /* a prefill chunk that has not reached the end */
    }
    if (token == Py_None) {
        Py_DECREF(output);
        PyObject *rid = get(seq, F_REQUEST_ID);
        if (rid != NULL) {
            PyErr_Format(PyExc_ValueError, "no token sampled for %R", rid);
            Py_DECREF(rid);
        }
        return -1;
    }
    int rc = append_token(seq, output, nprompt, token, bs);
    Py_ssize_t nout = PyList_GET_SIZE(output);
    Py_DECREF(output);
    if (rc < 0)
        return -1;
    PyObject *reason, *pair = PyTuple_New(2); /* (seq, token): what the delivery reads */
    if (pair == NULL)
        return -1;
    PyTuple_SET_ITEM(pair, 0, Py_NewRef(seq));
    PyTuple_SET_ITEM(pair, 1, Py_NewRef(token));
    rc = PyList_Append(tokens_out, pair);
    Py_DECREF(pair);
    if (rc < 0 || finish_reason(seq, nout, token, &reason) < 0)
        return -1;
    if (reason != NULL) {
        if (put(seq, F_FINISH_REASON, reason) < 0 || put(seq, F_STATUS, st_finished) < 0 ||
            PyList_Append(finished, seq) < 0)
            return -1;
    }
    return 0;
}

/* The finished release their blocks and leave the request table and the running list. */
static int
retire(PyObject *kv, PyObject *finished, PyObject *running, PyObject *requests)
{
    Py_ssize_t count = PyList_GET_SIZE(finished);
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *seq = PyList_GET_ITEM(finished, k);
        if (release(kv, seq) < 0)
            return -1;
        PyObject *rid = get(seq, F_REQUEST_ID);
        if (rid == NULL)
            return -1;
        int rc = PyObject_DelItem(requests, rid);
        Py_DECREF(rid);
        if (rc < 0)
            return -1;
    }
    PyObject *keep = PyList_New(0);
    if (keep == NULL)
        return -1;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(running); k++) {
        PyObject *seq = PyList_GET_ITEM(running, k);
        int alive = status_is(seq, st_running);
        if (alive < 0 || (alive && PyList_Append(keep, seq) < 0)) {
            Py_DECREF(keep);
            return -1;
        }
    }
    int rc = PyList_SetSlice(running, 0, PyList_GET_SIZE(running), keep);
    Py_DECREF(keep);
    return rc;
}

static PyObject *update_core(const Batch *b, PyObject *sampled, PyObject *running,
                             PyObject *requests, PyObject *kv, Py_ssize_t bs, PyObject *drain);

/* update_pass's checks, then its work; its events are ``kv.<drain>()``. */
static PyObject *
update_with(PyObject *const *args, Py_ssize_t nargs, PyObject *drain)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "update_pass(entries, sampled, running, requests, kv, block_size)");
        return NULL;
    }
    PyObject *entries = args[0], *sampled = args[1], *running = args[2], *requests = args[3];
    PyObject *kv = args[4];
    if (!PyList_Check(entries) || !PyList_Check(sampled) || !PyList_Check(running)) {
        PyErr_SetString(PyExc_TypeError, "entries, sampled and running must be lists");
        return NULL;
    }
    if (PyList_GET_SIZE(entries) != PyList_GET_SIZE(sampled)) {
        PyErr_SetString(PyExc_ValueError, "sampled must have one item per batch entry");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[5]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    if (ensure_ready() < 0)
        return NULL;
    Batch b = {.list = entries, .count = PyList_GET_SIZE(entries)};
    return update_core(&b, sampled, running, requests, kv, bs, drain);
}

/* Apply the pass (``sampled``: one item per batch entry): (tokens, finished, events). */
static PyObject *
update_core(const Batch *b, PyObject *sampled, PyObject *running, PyObject *requests,
            PyObject *kv, Py_ssize_t bs, PyObject *drain)
{
    int caching = kv_native(kv) ? kv_api->caching(kv) : config_bool(kv, s_enable_prefix_caching);
    if (caching < 0)
        return NULL;
    PyObject *tokens_out = PyList_New(0), *finished = PyList_New(0), *events = NULL;
    PyObject *result = NULL;
    if (tokens_out == NULL || finished == NULL)
        goto done;
    Py_ssize_t count = b->count;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *seq;
        Py_ssize_t n;
        if (batch_at(b, i, &seq, &n) < 0)
            goto done;
        Py_INCREF(seq);
        int rc = advance_one(kv, seq, n, PyList_GET_ITEM(sampled, i), bs, caching, tokens_out,
                             finished, b->ntok ? b->ntok[i] : -1,
                             b->computed ? b->computed[i] : -1);
        Py_DECREF(seq);
        if (rc < 0)
            goto done;
    }
    if (PyList_GET_SIZE(finished) > 0 && retire(kv, finished, running, requests) < 0)
        goto done;
    if (kv_native(kv)) {
        events = kv_api->drain(kv, drain == s_drain_raw_events);
    } else {
        PyObject *argv[1] = {kv};
        events = PyObject_VectorcallMethod(drain, argv, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    if (events == NULL)
        goto done;
    PyObject *parts[3] = {tokens_out, finished, events};
    result = tuple_of(3, parts, NULL);
done:
    Py_XDECREF(tokens_out);
    Py_XDECREF(finished);
    Py_XDECREF(events);
    return result;
}

/* update_pass(entries, sampled, running, requests, kv, block_size): see _pass.pyi. */
static PyObject *
update_pass(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return update_with(args, nargs, s_drain_events);
}

/* mock_pass(running, waiting, requests, kv, config, now, transfer_seconds, vocab_size,
 *           excluded): see _pass.pyi. */
static PyObject *
mock_pass(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "mock_pass(running, waiting, requests, kv, config, now, "
                        "transfer_seconds, vocab_size, excluded)");
        return NULL;
    }
    PyObject *running = args[0], *waiting = args[1], *requests = args[2], *kv = args[3];
    PyObject *sargs[6] = {running, waiting, kv, args[4], args[5], args[6]};
    Pass ps = {0};
    Py_ssize_t first[PLAN_FIRST * 5]; /* the plan's first arrays (plan_grow) */
    ps.plan.first = first;
    Py_ssize_t figures[3];
    unsigned long long vocab;
    PyObject *sampled = NULL, *applied = NULL, *result = NULL;
    if (schedule_into(sargs, &ps, figures) < 0 || sample_args(args[7], args[8], &vocab) < 0)
        goto done;
    /* the planned batch as it is, with no (sequence, tokens) tuple an entry */
    Batch b = {.seq = ps.plan.seq, .n = ps.plan.n, .count = ps.plan.len, .ntok = ps.plan.ntok,
               .computed = ps.plan.computed};
    if ((sampled = sample_core(&b, vocab, args[8])) == NULL)
        goto done;
    /* the events in their raw form (kv_raw.py) */
    int raw = kv_native(kv) ? kv_api->raw(kv) : config_bool(kv, s_raw_events);
    if (raw < 0 || (applied = update_core(&b, sampled, running, requests, kv, ps.bs,
                                          raw ? s_drain_raw_events : s_drain_events)) == NULL)
        goto done;
    PyObject *items[7] = {ps.preempted, NULL, NULL, NULL, PyTuple_GET_ITEM(applied, 0),
                          PyTuple_GET_ITEM(applied, 1), PyTuple_GET_ITEM(applied, 2)};
    result = tuple_of(7, items, figures);
done:
    plan_free(&ps.plan);
    Py_XDECREF(ps.preempted);
    Py_XDECREF(sampled);
    Py_XDECREF(applied);
    return result;
}

static PyMethodDef module_methods[] = {
    {"sample_tokens", (PyCFunction)(void (*)(void))sample_tokens, METH_FASTCALL,
     "sample_tokens(entries, vocab_size, excluded): the mocker's id for each sampling entry."},
    {"schedule_pass", (PyCFunction)(void (*)(void))schedule_pass, METH_FASTCALL,
     "schedule_pass(running, waiting, kv, config, now, transfer_seconds): plan and allocate "
     "one pass; (entries, preempted, num_prefill_tokens, num_decodes, decode_context_tokens)."},
    {"update_pass", (PyCFunction)(void (*)(void))update_pass, METH_FASTCALL,
     "update_pass(entries, sampled, running, requests, kv, block_size): apply a pass; "
     "(tokens, finished, events)."},
    {"mock_pass", (PyCFunction)(void (*)(void))mock_pass, METH_FASTCALL,
     "mock_pass(running, waiting, requests, kv, config, now, transfer_seconds, vocab_size, "
     "excluded): schedule, sample and apply one mocker pass; (preempted, num_prefill_tokens, "
     "num_decodes, decode_context_tokens, tokens, finished, events)."},
    {"release_blocks", (PyCFunction)(void (*)(void))release_blocks, METH_FASTCALL,
     "release_blocks(kv, seq): release a sequence's blocks and empty its block lists."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef pass_module = {
    PyModuleDef_HEAD_INIT, "dynamo.engine_core._pass",
    "Native scheduler pass (see _pass.pyi).", -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__pass(void)
{
    if (dyn_slots_init(&seq_slots) < 0)
        return NULL;
#define INTERN(var, text)                                                                     \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                    \
        return NULL;
    INTERN(s_num_cached_prefix, "num_cached_prefix");
    INTERN(s_num_slots_needed, "num_slots_needed");
    INTERN(s_num_available_blocks, "num_available_blocks");
    INTERN(s_use, "use");
    INTERN(s_allocate_unique, "allocate_unique");
    INTERN(s_promote_run, "promote_run");
    INTERN(s_release, "release");
    INTERN(s_drain_events, "drain_events");
    INTERN(s_drain_raw_events, "drain_raw_events");
    INTERN(s_raw_events, "raw_events");
    INTERN(s_enable_prefix_caching, "enable_prefix_caching");
    INTERN(s_max_num_batched_tokens, "max_num_batched_tokens");
    INTERN(s_block_size, "block_size");
    INTERN(s_preemption_mode, "preemption_mode");
    INTERN(s_max_num_seqs, "max_num_seqs");
    INTERN(s_enable_chunked_prefill, "enable_chunked_prefill");
    INTERN(s_popleft, "popleft");
    INTERN(s_appendleft, "appendleft");
    INTERN(s_num_cached_tokens, "num_cached_tokens");
#undef INTERN
    if ((s_announce_kw = Py_BuildValue("(s)", "announce")) == NULL)
        return NULL;
    return PyModule_Create(&pass_module);
}

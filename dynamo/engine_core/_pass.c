/*
 * dynamo.engine_core._pass: the per-entry, per-token loops of one scheduler pass.
 *
 * Why native: every pass of every DP rank walks its batch twice per output token, once to
 * sample (the mocker's ids) and once to apply the pass (advance progress, append the token, hash
 * a completed block, check the stop rules). In the offline replay these two loops were ~20 % of
 * the CPU (docs/performance.md, "Offline replay"); the live mocker runs the same loops. The
 * contract of both functions is ``_pass.pyi``; ``_pass_fallback.py`` is the same contract in
 * Python (``dynamo.native`` picks one), and tests/unit/engine_core/test_pass_kernels.py holds
 * the two to the same outputs.
 *
 * Sequences are the scheduler's ``Sequence`` objects (slotted dataclass): their fields are read
 * and written through attribute access, so both implementations mutate the same state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define LCG_MUL 6364136223846793005ULL
#define LCG_INC 1442695040888963407ULL
#define SEQUENCE_SEED 1337ULL /* router.hashing.XXH3_SEED: the seed of the chained hash */

static PyObject *s_pending_transfer, *s_ready_at, *s_prefill_end, *s_tokens, *s_num_computed_tokens, *s_rng_state, *s_banned_token_ids,
    *s_status, *s_unique_blocks, *s_full_blocks, *s_num_prompt_tokens, *s_max_tokens,
    *s_min_tokens, *s_stop_token_ids, *s_hash_seed, *s_local_hashes, *s_block_hashes,
    *s_finish_reason, *s_request_id;

/* An attribute that must be a Py_ssize_t-sized int; -1 with an exception set on error. */
static int
get_ssize(PyObject *obj, PyObject *name, Py_ssize_t *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

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

/* 1 if token is in the set (a frozenset or set; None or empty: never), 0 if not, -1 on error. */
static int
in_set(PyObject *set, PyObject *token)
{
    if (set == Py_None || PySet_GET_SIZE(set) == 0)
        return 0;
    return PySet_Contains(set, token);
}

static PyObject *
sample_tokens(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sample_tokens(entries, vocab_size, excluded)");
        return NULL;
    }
    PyObject *entries = args[0], *excluded = args[2];
    if (!PyList_Check(entries)) {
        PyErr_SetString(PyExc_TypeError, "entries must be a list");
        return NULL;
    }
    if (!PyAnySet_Check(excluded)) {
        PyErr_SetString(PyExc_TypeError, "excluded must be a set or frozenset");
        return NULL;
    }
    unsigned long long vocab = PyLong_AsUnsignedLongLong(args[1]);
    if (vocab == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(entries);
    PyObject *out = PyList_New(count);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *seq, *tokens, *rng, *banned, *token = NULL;
        Py_ssize_t n, computed;
        if (entry_parts(PyList_GET_ITEM(entries, i), &seq, &n) < 0)
            goto fail;
        tokens = PyObject_GetAttr(seq, s_tokens);
        if (tokens == NULL)
            goto fail;
        Py_ssize_t position = PyObject_Length(tokens);
        Py_DECREF(tokens);
        if (position < 0 || get_ssize(seq, s_num_computed_tokens, &computed) < 0)
            goto fail;
        if (computed + n < position) {
            PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
            continue;
        }
        rng = PyObject_GetAttr(seq, s_rng_state);
        if (rng == NULL)
            goto fail;
        uint64_t z = PyLong_AsUnsignedLongLongMask(rng); /* the state mod 2**64 */
        Py_DECREF(rng);
        if (z == (uint64_t)-1 && PyErr_Occurred())
            goto fail;
        /* SplitMix64's finaliser over (seed, position): as the fallback, bit for bit */
        z += GOLDEN * (uint64_t)(position + 1);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        uint64_t state = z ^ (z >> 31);
        banned = PyObject_GetAttr(seq, s_banned_token_ids);
        if (banned == NULL)
            goto fail;
        if (banned != Py_None && !PyAnySet_Check(banned)) {
            Py_DECREF(banned);
            PyErr_SetString(PyExc_TypeError, "banned_token_ids must be a set or frozenset");
            goto fail;
        }
        for (;;) {
            uint64_t id = (uint64_t)(((unsigned __int128)(state >> 32) * vocab) >> 32);
            token = PyLong_FromUnsignedLongLong(id);
            if (token == NULL)
                break;
            int hit = in_set(excluded, token);
            if (hit == 0)
                hit = in_set(banned, token);
            if (hit == 0)
                break;
            Py_CLEAR(token);
            if (hit < 0)
                break;
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

/* xxh3(bytes, seed) through the caller's hash function (xxhash.xxh3_64_intdigest). */
static PyObject *
call_hash(PyObject *hash_fn, const char *data, Py_ssize_t len, PyObject *seed)
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

/* Sequence.append_token: append, and hash the block the token completes (if it does). */
static int
append_token(PyObject *seq, PyObject *tokens, PyObject *token, Py_ssize_t block_size,
             PyObject *hash_fn, PyObject *chain_seed)
{
    if (PyList_Append(tokens, token) < 0)
        return -1;
    Py_ssize_t len = PyList_GET_SIZE(tokens);
    if (len % block_size != 0)
        return 0;
    int rc = -1;
    PyObject *seed = NULL, *local = NULL, *locals = NULL, *chain = NULL, *next = NULL;
    unsigned char *buf = PyMem_Malloc((size_t)block_size * 4);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < block_size; k++) {
        /* array('I', ...) semantics: an id outside [0, 2**32) is an OverflowError */
        unsigned long t = PyLong_AsUnsignedLong(PyList_GET_ITEM(tokens, len - block_size + k));
        if (t == (unsigned long)-1 && PyErr_Occurred())
            goto done;
        if (t > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_OverflowError, "token id does not fit in 32 bits");
            goto done;
        }
        for (int b = 0; b < 4; b++)
            buf[4 * k + b] = (unsigned char)(t >> (8 * b));
    }
    if ((seed = PyObject_GetAttr(seq, s_hash_seed)) == NULL)
        goto done;
    if ((local = call_hash(hash_fn, (const char *)buf, block_size * 4, seed)) == NULL)
        goto done;
    if ((locals = PyObject_GetAttr(seq, s_local_hashes)) == NULL)
        goto done;
    if ((chain = PyObject_GetAttr(seq, s_block_hashes)) == NULL)
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
        uint64_t parent = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(chain, depth - 1));
        if (parent == (uint64_t)-1 && PyErr_Occurred())
            goto done;
        uint64_t lo = PyLong_AsUnsignedLongLong(local);
        if (lo == (uint64_t)-1 && PyErr_Occurred())
            goto done;
        put_u64_le(pair, parent);
        put_u64_le(pair + 8, lo);
        if ((next = call_hash(hash_fn, (const char *)pair, 16, chain_seed)) == NULL)
            goto done;
    }
    rc = PyList_Append(chain, next);
done:
    PyMem_Free(buf);
    Py_XDECREF(seed);
    Py_XDECREF(local);
    Py_XDECREF(locals);
    Py_XDECREF(chain);
    Py_XDECREF(next);
    return rc;
}

/* Sequence.finish_after: the reason (borrowed: length or stop) or NULL to go on; -1 on error. */
static int
finish_reason(PyObject *seq, Py_ssize_t num_tokens, PyObject *token, PyObject *length,
              PyObject *stop, PyObject **reason)
{
    Py_ssize_t prompt, max_tokens, min_tokens;
    *reason = NULL;
    if (get_ssize(seq, s_num_prompt_tokens, &prompt) < 0 ||
        get_ssize(seq, s_max_tokens, &max_tokens) < 0)
        return -1;
    Py_ssize_t n = num_tokens - prompt;
    if (n >= max_tokens) {
        *reason = length;
        return 0;
    }
    if (get_ssize(seq, s_min_tokens, &min_tokens) < 0)
        return -1;
    if (n < min_tokens)
        return 0;
    PyObject *stops = PyObject_GetAttr(seq, s_stop_token_ids);
    if (stops == NULL)
        return -1;
    int hit = PySequence_Contains(stops, token);
    Py_DECREF(stops);
    if (hit < 0)
        return -1;
    if (hit)
        *reason = stop;
    return 0;
}

/* advance(entries, sampled, block_size, caching, running, finished, length, stop, promote,
 *         hash_fn) -> (tokens, finished): see _pass.pyi. */
static PyObject *
advance(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "advance(entries, sampled, block_size, caching, running, finished, "
                        "length, stop, promote, hash_fn)");
        return NULL;
    }
    PyObject *entries = args[0], *sampled = args[1];
    PyObject *running = args[4], *finished_status = args[5], *length = args[6], *stop = args[7];
    PyObject *promote = args[8], *hash_fn = args[9];
    if (!PyList_Check(entries) || !PyList_Check(sampled)) {
        PyErr_SetString(PyExc_TypeError, "entries and sampled must be lists");
        return NULL;
    }
    if (PyList_GET_SIZE(entries) != PyList_GET_SIZE(sampled)) {
        PyErr_SetString(PyExc_ValueError, "sampled must have one item per batch entry");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    int caching = PyObject_IsTrue(args[3]);
    if (caching < 0)
        return NULL;
    PyObject *chain_seed = PyLong_FromUnsignedLongLong(SEQUENCE_SEED);
    PyObject *tokens_out = PyList_New(0), *finished = PyList_New(0);
    if (chain_seed == NULL || tokens_out == NULL || finished == NULL)
        goto fail;
    Py_ssize_t count = PyList_GET_SIZE(entries);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *seq, *status, *tokens, *pair, *reason;
        Py_ssize_t n, computed;
        if (entry_parts(PyList_GET_ITEM(entries, i), &seq, &n) < 0)
            goto fail;
        if ((status = PyObject_GetAttr(seq, s_status)) == NULL)
            goto fail;
        Py_DECREF(status); /* identity only: the enum member lives on in its class */
        if (status != running)
            continue; /* aborted while the pass ran */
        if (get_ssize(seq, s_num_computed_tokens, &computed) < 0)
            goto fail;
        computed += n;
        PyObject *value = PyLong_FromSsize_t(computed);
        if (value == NULL)
            goto fail;
        int set = PyObject_SetAttr(seq, s_num_computed_tokens, value);
        Py_DECREF(value);
        if (set < 0)
            goto fail;
        if (caching) {
            PyObject *unique = PyObject_GetAttr(seq, s_unique_blocks);
            if (unique == NULL)
                goto fail;
            Py_ssize_t n_unique = PyObject_Length(unique);
            Py_DECREF(unique);
            if (n_unique < 0)
                goto fail;
            if (n_unique > 0) {
                PyObject *full = PyObject_GetAttr(seq, s_full_blocks);
                if (full == NULL)
                    goto fail;
                Py_ssize_t n_full = PyObject_Length(full);
                Py_DECREF(full);
                if (n_full < 0)
                    goto fail;
                if (computed >= (n_full + 1) * block_size) {
                    PyObject *r = PyObject_CallOneArg(promote, seq);
                    if (r == NULL)
                        goto fail;
                    Py_DECREF(r);
                }
            }
        }
        if ((tokens = PyObject_GetAttr(seq, s_tokens)) == NULL)
            goto fail;
        if (!PyList_Check(tokens)) {
            Py_DECREF(tokens);
            PyErr_SetString(PyExc_TypeError, "tokens must be a list");
            goto fail;
        }
        if (computed < PyList_GET_SIZE(tokens)) {
            Py_DECREF(tokens);
            continue; /* a prefill chunk that has not reached the end */
        }
        PyObject *token = PyList_GET_ITEM(sampled, i);
        if (token == Py_None) {
            Py_DECREF(tokens);
            PyObject *rid = PyObject_GetAttr(seq, s_request_id);
            if (rid != NULL) {
                PyErr_Format(PyExc_ValueError, "no token sampled for %R", rid);
                Py_DECREF(rid);
            }
            goto fail;
        }
        int rc = append_token(seq, tokens, token, block_size, hash_fn, chain_seed);
        Py_ssize_t num_tokens = PyList_GET_SIZE(tokens);
        Py_DECREF(tokens);
        if (rc < 0)
            goto fail;
        if ((pair = PyTuple_Pack(2, seq, token)) == NULL)
            goto fail;
        rc = PyList_Append(tokens_out, pair);
        Py_DECREF(pair);
        if (rc < 0 || finish_reason(seq, num_tokens, token, length, stop, &reason) < 0)
            goto fail;
        if (reason != NULL) {
            if (PyObject_SetAttr(seq, s_finish_reason, reason) < 0 ||
                PyObject_SetAttr(seq, s_status, finished_status) < 0 ||
                PyList_Append(finished, seq) < 0)
                goto fail;
        }
    }
    Py_DECREF(chain_seed);
    PyObject *result = PyTuple_Pack(2, tokens_out, finished);
    Py_DECREF(tokens_out);
    Py_DECREF(finished);
    return result;
fail:
    Py_XDECREF(chain_seed);
    Py_XDECREF(tokens_out);
    Py_XDECREF(finished);
    return NULL;
}


static Py_ssize_t
length_of(PyObject *seq, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(seq, name);
    if (v == NULL)
        return -1;
    Py_ssize_t n = PyObject_Length(v);
    Py_DECREF(v);
    return n;
}

/* plan_running(running, i, budget, now, block_size, scheduled) -> (i, budget, grow): see
 * _pass.pyi. */
static PyObject *
plan_running(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "plan_running(running, i, budget, now, block_size, scheduled)");
        return NULL;
    }
    PyObject *running = args[0], *scheduled = args[5];
    if (!PyList_Check(running) || !PyDict_Check(scheduled)) {
        PyErr_SetString(PyExc_TypeError, "running must be a list and scheduled a dict");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t budget = PyLong_AsSsize_t(args[2]);
    if (budget == -1 && PyErr_Occurred())
        return NULL;
    double now = PyFloat_AsDouble(args[3]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    Py_ssize_t block_size = PyLong_AsSsize_t(args[4]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    int grow = 0;
    while (i < PyList_GET_SIZE(running) && budget > 0) {
        PyObject *seq = PyList_GET_ITEM(running, i);
        Py_INCREF(seq);
        PyObject *pending = PyObject_GetAttr(seq, s_pending_transfer);
        int waiting = pending == NULL ? -1 : PyObject_IsTrue(pending);
        Py_XDECREF(pending);
        if (waiting < 0)
            goto fail;
        if (waiting) {
            PyObject *ready = PyObject_GetAttr(seq, s_ready_at);
            if (ready == NULL)
                goto fail;
            double at = PyFloat_AsDouble(ready);
            Py_DECREF(ready);
            if (at == -1.0 && PyErr_Occurred())
                goto fail;
            if (at > now) { /* its KV transfer has not landed yet */
                Py_DECREF(seq);
                i++;
                continue;
            }
            if (PyObject_SetAttr(seq, s_pending_transfer, Py_False) < 0)
                goto fail;
        }
        Py_ssize_t num_tokens = length_of(seq, s_tokens), computed, prefill_end;
        if (num_tokens < 0 || get_ssize(seq, s_num_computed_tokens, &computed) < 0 ||
            get_ssize(seq, s_prefill_end, &prefill_end) < 0)
            goto fail;
        if (computed >= prefill_end) {
            Py_ssize_t full = length_of(seq, s_full_blocks);
            Py_ssize_t unique = full < 0 ? -1 : length_of(seq, s_unique_blocks);
            if (unique < 0)
                goto fail;
            if (num_tokens > block_size * (full + unique)) {
                Py_DECREF(seq); /* a decode whose token starts a new block: the caller grows it */
                grow = 1;
                break;
            }
        }
        i++;
        Py_ssize_t n = num_tokens - computed;
        if (n > budget)
            n = budget;
        PyObject *key = PyLong_FromVoidPtr(seq), *count = PyLong_FromSsize_t(n);
        PyObject *entry = (key && count) ? PyTuple_Pack(2, seq, count) : NULL;
        int r = entry ? PyDict_SetItem(scheduled, key, entry) : -1;
        Py_XDECREF(key);
        Py_XDECREF(count);
        Py_XDECREF(entry);
        if (r < 0)
            goto fail;
        budget -= n;
        Py_DECREF(seq);
        continue;
    fail:
        Py_DECREF(seq);
        return NULL;
    }
    return Py_BuildValue("nnO", i, budget, grow ? Py_True : Py_False);
}

static PyMethodDef module_methods[] = {
    {"sample_tokens", (PyCFunction)(void (*)(void))sample_tokens, METH_FASTCALL,
     "sample_tokens(entries, vocab_size, excluded): the mocker's id for each sampling entry."},
    {"advance", (PyCFunction)(void (*)(void))advance, METH_FASTCALL,
     "advance(entries, sampled, block_size, caching, running, finished, length, stop, promote, "
     "hash_fn): apply a pass's progress and tokens; (tokens, finished)."},
    {"plan_running", (PyCFunction)(void (*)(void))plan_running, METH_FASTCALL,
     "plan_running(running, i, budget, now, block_size, scheduled): schedule running "
     "sequences from i until one must grow; (i, budget, grow)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef pass_module = {
    PyModuleDef_HEAD_INIT, "dynamo.engine_core._pass",
    "Native per-entry loops of a scheduler pass (see _pass.pyi).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__pass(void)
{
#define INTERN(var, text)                                                                     \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                    \
        return NULL;
    INTERN(s_pending_transfer, "pending_transfer");
    INTERN(s_ready_at, "ready_at");
    INTERN(s_prefill_end, "prefill_end");
    INTERN(s_tokens, "tokens");
    INTERN(s_num_computed_tokens, "num_computed_tokens");
    INTERN(s_rng_state, "rng_state");
    INTERN(s_banned_token_ids, "banned_token_ids");
    INTERN(s_status, "status");
    INTERN(s_unique_blocks, "unique_blocks");
    INTERN(s_full_blocks, "full_blocks");
    INTERN(s_num_prompt_tokens, "num_prompt_tokens");
    INTERN(s_max_tokens, "max_tokens");
    INTERN(s_min_tokens, "min_tokens");
    INTERN(s_stop_token_ids, "stop_token_ids");
    INTERN(s_hash_seed, "hash_seed");
    INTERN(s_local_hashes, "local_hashes");
    INTERN(s_block_hashes, "block_hashes");
    INTERN(s_finish_reason, "finish_reason");
    INTERN(s_request_id, "request_id");
#undef INTERN
    return PyModule_Create(&pass_module);
}

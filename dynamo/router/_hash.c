/*
 * dynamo.router._hash: KV block hashing (FACTS §1), the loops of router/hashing.py in C.
 *
 * Why native: every request is hashed block by block where it is routed (the KV router, the
 * offline replay) and every decode block an engine completes is hashed again. In Python each
 * block cost a bytes slice, an interpreter round and a call (~0.3 µs), and each chained hash a
 * struct pack as well (~0.35 µs): ~8 % of the offline replay's CPU for a 72-block prompt
 * (docs/performance.md, "Offline replay"). Here a block is XXH3-64 over a stack buffer.
 *
 * XXH3-64 is the reference implementation (vendor/xxhash.h, xxHash 0.8.2, BSD-2-Clause: the
 * algorithm the Python ``xxhash`` package wraps; its output is frozen since 0.8.0). The contract
 * is ``_hash.pyi``; ``_hash_fallback.py`` is the same in Python (``dynamo.native`` picks one) and
 * tests/unit/router/test_hash_native.py holds the two to the same outputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#define XXH_NO_STREAM
#include "vendor/xxhash.h"
#include "../_u64.h"

#define SEQUENCE_SEED 1337ULL /* router.hashing.XXH3_SEED */

/* A token id: an exact int of at most one 30-bit digit is read from its digit (CPython 3.11's
 * layout: every id below 2**30, i.e. every vocabulary); anything else through the API, which
 * gives the same value for such an int. */
static inline unsigned long
token_id(PyObject *obj)
{
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    if (PyLong_CheckExact(obj)) {
        Py_ssize_t size = Py_SIZE(obj);
        if (size == 0)
            return 0;
        if (size == 1)
            return ((PyLongObject *)obj)->ob_digit[0];
    }
#endif
    return PyLong_AsUnsignedLong(obj);
}

/* Convert tokens[0..n) to u32 little-endian bytes; array('I') semantics for bad ids. */
static int
token_bytes(PyObject *const *items, Py_ssize_t n, unsigned char *out)
{
    for (Py_ssize_t k = 0; k < n; k++) {
        uint32_t u;
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
        /* the common id (an exact int of one digit) without the checks of any other */
        PyObject *obj = items[k];
        if (PyLong_CheckExact(obj) && Py_SIZE(obj) == 1)
            u = ((PyLongObject *)obj)->ob_digit[0];
        else
#endif
        {
            unsigned long t = token_id(items[k]);
            if (t == (unsigned long)-1 && PyErr_Occurred())
                return -1;
            if (t > 0xFFFFFFFFUL) {
                PyErr_SetString(PyExc_OverflowError, "unsigned int is greater than maximum");
                return -1;
            }
            u = (uint32_t)t;
        }
#if PY_LITTLE_ENDIAN
        memcpy(out + 4 * k, &u, 4);
#else
        out[4 * k] = (unsigned char)u;
        out[4 * k + 1] = (unsigned char)(u >> 8);
        out[4 * k + 2] = (unsigned char)(u >> 16);
        out[4 * k + 3] = (unsigned char)(u >> 24);
#endif
    }
    return 0;
}

static int
as_u64(PyObject *value, uint64_t *out)
{
    if (dyn_u64_digits(value, out))
        return 0;
    *out = DYN_AS_U64(value);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static inline uint64_t
chain(uint64_t parent, uint64_t local)
{
    unsigned char pair[16];
    for (int k = 0; k < 8; k++) {
        pair[k] = (unsigned char)(parent >> (8 * k));
        pair[8 + k] = (unsigned char)(local >> (8 * k));
    }
    return XXH3_64bits_withSeed(pair, 16, SEQUENCE_SEED);
}

/* ``known``'s (known_tokens, known_local, known_chained: a ``prompt_hashes`` result) hash lists
 * as *kl and *kc (new references) and *limit, how many of ``blocks`` both cover: 0, or -1 with
 * an exception. */
static int
known_hashes(PyObject *const *known, Py_ssize_t blocks, PyObject **kl, PyObject **kc,
             Py_ssize_t *limit)
{
    *kl = PySequence_Fast(known[1], "known_local must be a sequence");
    *kc = *kl ? PySequence_Fast(known[2], "known_chained must be a sequence") : NULL;
    if (*kc == NULL) {
        Py_CLEAR(*kl);
        return -1;
    }
    *limit = blocks;
    if (PySequence_Fast_GET_SIZE(*kl) < *limit)
        *limit = PySequence_Fast_GET_SIZE(*kl);
    if (PySequence_Fast_GET_SIZE(*kc) < *limit)
        *limit = PySequence_Fast_GET_SIZE(*kc);
    return 0;
}

/* From block ``k`` on (below ``limit``), the first block whose ids (u32, little-endian, at
 * ``buf``) differ from known_tokens' ``kitems`` by value; ``items`` (the prompt's objects, or
 * NULL) spares the read of a known id that is the prompt's own object. A known item that is
 * not a valid id ends the shared blocks. */
static Py_ssize_t
first_differing_block(PyObject *const *items, const unsigned char *buf, PyObject *const *kitems,
                      Py_ssize_t k, Py_ssize_t limit, Py_ssize_t block_size)
{
    for (; k < limit; k++) {
        Py_ssize_t i = k * block_size, hi = i + block_size;
        for (; i < hi; i++) {
            if (items != NULL && items[i] == kitems[i])
                continue; /* the same object: the same id */
            unsigned long t = token_id(kitems[i]);
            if (t == (unsigned long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                break;
            }
            const unsigned char *b = buf + 4 * i;
            unsigned long v = (unsigned long)b[0] | (unsigned long)b[1] << 8 |
                              (unsigned long)b[2] << 16 | (unsigned long)b[3] << 24;
            if (t != v)
                break;
        }
        if (i < hi)
            break;
    }
    return k;
}

/* out[0..k) / chain_out[0..k) take known's hash objects, *prev the last chained value: k, or
 * -1 with an exception. */
static Py_ssize_t
adopt_known(PyObject *kl, PyObject *kc, Py_ssize_t k, PyObject *out, PyObject *chain_out,
            uint64_t *prev)
{
    for (Py_ssize_t j = 0; j < k; j++) {
        PyList_SET_ITEM(out, j, Py_NewRef(PySequence_Fast_ITEMS(kl)[j]));
        PyList_SET_ITEM(chain_out, j, Py_NewRef(PySequence_Fast_ITEMS(kc)[j]));
    }
    return k > 0 && as_u64(PySequence_Fast_ITEMS(kc)[k - 1], prev) < 0 ? -1 : k;
}

/* With ``known`` (known_tokens, known_local, known_chained: a ``prompt_hashes`` result):
 * convert ids[from..n) of ``items`` into ``buf`` and fill out[0..k) / chain_out[0..k) with
 * known's hash objects for the k leading complete blocks whose ids equal known_tokens', *prev
 * with the last chained value. The leading ids that are known_tokens' own objects are not
 * read (``from`` is past them: checked when known was hashed); a later block is compared by
 * value. Returns k, or -1 with an exception. */
static Py_ssize_t
reuse_known(PyObject *const *items, Py_ssize_t n, unsigned char *buf, Py_ssize_t block_size,
            Py_ssize_t blocks, PyObject *const *known, PyObject *out, PyObject *chain_out,
            uint64_t *prev)
{
    Py_ssize_t k = -1, limit;
    PyObject *kl = NULL, *kc = NULL;
    PyObject *kt = PySequence_Fast(known[0], "known_tokens must be a sequence of ints");
    if (kt == NULL || known_hashes(known, blocks, &kl, &kc, &limit) < 0)
        goto done;
    if (PySequence_Fast_GET_SIZE(kt) / block_size < limit)
        limit = PySequence_Fast_GET_SIZE(kt) / block_size;
    PyObject *const *kitems = PySequence_Fast_ITEMS(kt);
    /* The leading blocks whose ids are known_tokens' own objects, a block's pointers compared
     * at once (a prompt of a prefix group shares its group's 64 blocks: a vector compare each,
     * not 1,024 compared one by one). */
    size_t width = (size_t)block_size * sizeof(PyObject *);
    k = 0;
    while (k < limit && memcmp(items + k * block_size, kitems + k * block_size, width) == 0)
        k++;
    Py_ssize_t from = k * block_size;
    if (token_bytes(items + from, n - from, buf + 4 * from) < 0) {
        k = -1;
        goto done;
    }
    k = first_differing_block(items, buf, kitems, k, limit, block_size);
    k = adopt_known(kl, kc, k, out, chain_out, prev);
done:
    Py_XDECREF(kt);
    Py_XDECREF(kl);
    Py_XDECREF(kc);
    return k;
}

/* Whether ``obj`` exposes its ids as u32 machine words (an ``array('I')``, the offline replay's
 * packed prompts) in little-endian order: then *view holds them (to release) and 1; else 0
 * (no exception: the caller reads it as a sequence). */
static int
u32_ids(PyObject *obj, Py_buffer *view)
{
#if PY_LITTLE_ENDIAN
    if (PyList_Check(obj) || PyTuple_Check(obj) || !PyObject_CheckBuffer(obj))
        return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->itemsize == 4 && view->format != NULL && strcmp(view->format, "I") == 0)
        return 1;
    PyBuffer_Release(view);
#endif
    return 0;
}

/* ``reuse_known`` for a prompt given as u32 ids (``ids``: ``n`` of them, little-endian): the
 * leading blocks equal to known_tokens' ids (compared a block at once when known_tokens is
 * u32 ids too, else id by id) take known's hashes. */
static Py_ssize_t
reuse_known_ids(const unsigned char *ids, Py_ssize_t n, Py_ssize_t block_size, Py_ssize_t blocks,
                PyObject *const *known, PyObject *out, PyObject *chain_out, uint64_t *prev)
{
    Py_ssize_t k = -1, limit;
    Py_buffer kv;
    int packed = 0;
    PyObject *kt = NULL, *kl = NULL, *kc = NULL;
    if (known_hashes(known, blocks, &kl, &kc, &limit) < 0)
        goto done;
    k = 0;
    if ((packed = u32_ids(known[0], &kv))) {
        size_t width = (size_t)block_size * 4;
        if (kv.len / 4 / block_size < limit)
            limit = kv.len / 4 / block_size;
        while (k < limit && memcmp(ids + k * width, (const char *)kv.buf + k * width, width) == 0)
            k++;
    }
    else {
        if ((kt = PySequence_Fast(known[0], "known_tokens must be a sequence of ints")) == NULL) {
            k = -1;
            goto done;
        }
        if (PySequence_Fast_GET_SIZE(kt) / block_size < limit)
            limit = PySequence_Fast_GET_SIZE(kt) / block_size;
        k = first_differing_block(NULL, ids, PySequence_Fast_ITEMS(kt), 0, limit, block_size);
    }
    k = adopt_known(kl, kc, k, out, chain_out, prev);
done:
    if (packed)
        PyBuffer_Release(&kv);
    Py_XDECREF(kt);
    Py_XDECREF(kl);
    Py_XDECREF(kc);
    return k;
}

/* The local hashes of (tokens, block_size, seed) and, when ``chained`` is not NULL, their
 * sequence hashes into *chained (computed from the same u64 values: no conversion back).
 * ``known`` (NULL, or with ``chained``: known_tokens, known_local, known_chained): the leading
 * blocks shared with known_tokens take known's hashes (``reuse_known``) instead of hashing. */
static PyObject *
block_hashes(PyObject *const *args, PyObject **chained, PyObject *const *known)
{
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    uint64_t seed;
    if ((block_size == -1 && PyErr_Occurred()) || as_u64(args[2], &seed) < 0)
        return NULL;
    if (block_size <= 0) {
        if (chained != NULL && (*chained = PyList_New(0)) == NULL)
            return NULL;
        return PyList_New(0);
    }
    /* a packed prompt's ids are hashed where they are; any other is converted (every token,
     * the tail too: a bad id fails as array('I') would; with ``known``, all but the ids that
     * are known_tokens' own objects: reuse_known) */
    Py_buffer view;
    int packed = u32_ids(args[0], &view);
    PyObject *seq = NULL, *out = NULL, *chain_out = NULL;
    unsigned char *buf = NULL;
    Py_ssize_t n;
    if (packed) {
        n = view.len / 4;
        buf = view.buf;
    }
    else {
        if ((seq = PySequence_Fast(args[0], "tokens must be a sequence of ints")) == NULL)
            return NULL;
        n = PySequence_Fast_GET_SIZE(seq);
        if ((buf = PyMem_Malloc(n > 0 ? (size_t)n * 4 : 1)) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_ssize_t blocks = n / block_size;
    if ((out = PyList_New(blocks)) == NULL)
        goto done;
    if (chained != NULL && (chain_out = PyList_New(blocks)) == NULL)
        goto fail;
    uint64_t prev = 0;
    Py_ssize_t start = 0;
    if (packed) {
        if (known != NULL && (start = reuse_known_ids(buf, n, block_size, blocks, known, out,
                                                      chain_out, &prev)) < 0)
            goto fail;
    }
    else if (known == NULL ? token_bytes(PySequence_Fast_ITEMS(seq), n, buf) < 0
                           : (start = reuse_known(PySequence_Fast_ITEMS(seq), n, buf, block_size,
                                                  blocks, known, out, chain_out, &prev)) < 0)
        goto fail;
    size_t width = (size_t)block_size * 4;
    for (Py_ssize_t i = start; i < blocks; i++) {
        uint64_t local = XXH3_64bits_withSeed(buf + i * width, width, seed);
        PyObject *h = PyLong_FromUnsignedLongLong(local);
        if (h == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, h);
        if (chain_out == NULL)
            continue;
        /* the first sequence hash is the first local hash itself */
        prev = i == 0 ? local : chain(prev, local);
        PyObject *c = i == 0 ? Py_NewRef(h) : PyLong_FromUnsignedLongLong(prev);
        if (c == NULL)
            goto fail;
        PyList_SET_ITEM(chain_out, i, c);
    }
    if (chained != NULL)
        *chained = chain_out;
done:
    if (packed)
        PyBuffer_Release(&view);
    else {
        PyMem_Free(buf);
        Py_DECREF(seq);
    }
    return out;
fail:
    Py_CLEAR(out);
    Py_CLEAR(chain_out);
    goto done;
}

static PyObject *
local_block_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "local_block_hashes(tokens, block_size, seed)");
        return NULL;
    }
    return block_hashes(args, NULL, NULL);
}

/* ``(local, chained)`` of args[0..3), reusing ``known``'s shared blocks when not NULL. */
static PyObject *
hash_pair(PyObject *const *args, PyObject *const *known)
{
    PyObject *chained = NULL;
    PyObject *local = block_hashes(args, &chained, known);
    if (local == NULL)
        return NULL;
    PyObject *pair = PyTuple_Pack(2, local, chained);
    Py_DECREF(local);
    Py_DECREF(chained);
    return pair;
}

static PyObject *
prompt_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "prompt_hashes(tokens, block_size, seed)");
        return NULL;
    }
    return hash_pair(args, NULL);
}

static PyObject *
prompt_hashes_after(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "prompt_hashes_after(tokens, block_size, seed, "
                                         "known_tokens, known_local, known_chained)");
        return NULL;
    }
    return hash_pair(args, args + 3);
}

static PyObject *
sequence_hashes(PyObject *module, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "local_hashes must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL || n == 0)
        goto done;
    /* the first sequence hash is the first local hash itself */
    PyList_SET_ITEM(out, 0, Py_NewRef(items[0]));
    uint64_t prev = 0;
    if (n > 1 && as_u64(items[0], &prev) < 0) /* only chained from: as the fallback */
        goto fail;
    for (Py_ssize_t i = 1; i < n; i++) {
        uint64_t local;
        if (as_u64(items[i], &local) < 0)
            goto fail;
        prev = chain(prev, local);
        PyObject *h = PyLong_FromUnsignedLongLong(prev);
        if (h == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, h);
    }
done:
    Py_DECREF(seq);
    return out;
fail:
    Py_CLEAR(out);
    goto done;
}

static PyObject *
block_hash(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "block_hash(tokens, seed)");
        return NULL;
    }
    uint64_t seed;
    if (as_u64(args[1], &seed) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "tokens must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = NULL;
    unsigned char *buf = PyMem_Malloc(n > 0 ? (size_t)n * 4 : 1);
    if (buf == NULL)
        PyErr_NoMemory();
    else if (token_bytes(PySequence_Fast_ITEMS(seq), n, buf) == 0)
        out = PyLong_FromUnsignedLongLong(XXH3_64bits_withSeed(buf, (size_t)n * 4, seed));
    PyMem_Free(buf);
    Py_DECREF(seq);
    return out;
}

static PyObject *
next_sequence_hash(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "next_sequence_hash(parent, local)");
        return NULL;
    }
    uint64_t parent, local;
    if (as_u64(args[0], &parent) < 0 || as_u64(args[1], &local) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(chain(parent, local));
}

static PyMethodDef module_methods[] = {
    {"local_block_hashes", (PyCFunction)(void (*)(void))local_block_hashes, METH_FASTCALL,
     "local_block_hashes(tokens, block_size, seed): XXH3-64 of each complete block."},
    {"prompt_hashes", (PyCFunction)(void (*)(void))prompt_hashes, METH_FASTCALL,
     "prompt_hashes(tokens, block_size, seed): (local_block_hashes, their sequence hashes)."},
    {"prompt_hashes_after", (PyCFunction)(void (*)(void))prompt_hashes_after, METH_FASTCALL,
     "prompt_hashes_after(tokens, block_size, seed, known_tokens, known_local, known_chained): "
     "prompt_hashes reusing the hashes of the blocks shared with a known prompt."},
    {"sequence_hashes", (PyCFunction)sequence_hashes, METH_O,
     "sequence_hashes(local_hashes): the chained hashes."},
    {"block_hash", (PyCFunction)(void (*)(void))block_hash, METH_FASTCALL,
     "block_hash(tokens, seed): XXH3-64 of one block."},
    {"next_sequence_hash", (PyCFunction)(void (*)(void))next_sequence_hash, METH_FASTCALL,
     "next_sequence_hash(parent, local): one chained hash."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hash_module = {
    PyModuleDef_HEAD_INIT, "dynamo.router._hash",
    "KV block hashing in C (see _hash.pyi).", -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__hash(void)
{
    return PyModule_Create(&hash_module);
}

/*
 * dynamo.slot_tracker._loads: POST /potential_loads from body bytes to answer bytes.
 *
 * Why: the endpoint is the slot tracker's hottest. Through the app it costs a msgspec Struct, a
 * Raw, four Python frames (handler, registry, ActiveSequences, the comprehension), one
 * PotentialLoad per rank and their encoding; here it is one C call from the HTTP server's
 * native path (a ``fast_routes`` entry, see runtime/http_json.py).
 *
 * Contract: potential_loads(trackers, body) returns the exact bytes the app's handler would
 * answer with 200, or None, and then the app answers (its errors, and anything this does not
 * take). Taken: a JSON object with exactly the members model_name and sequence_hashes and
 * optionally tenant_id and new_isl_tokens, each at most once, strings of printable ASCII
 * without escapes, new_isl_tokens a plain non-negative integer below 10**18, sequence_hashes an
 * array of integers; a tracker with KV reuse registered for (model_name, tenant_id).
 *
 * It reads the registry's objects: ``trackers`` maps (model_name, tenant_id) to an object whose
 * ``sequences`` is an ActiveSequences (router/sequences.py), read through its ``_rank_list``
 * and ``_assume_kv_reuse`` slots, each rank through ``worker_id``, ``dp_rank``,
 * ``prefill_tokens``, ``private_blocks``, ``num_requests`` and ``blocks`` (a BlockCounts of
 * prefix keys, used through its Python methods, so either implementation works); slots are read
 * in place where the type keeps them as plain object slots (slot_get). A test compares this
 * with the handler on random states and bodies.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

static PyObject *str_sequences, *str_rank_list, *str_kv_reuse, *str_worker_id, *str_dp_rank,
    *str_prefill, *str_private, *str_requests, *str_blocks, *str_count_absent,
    *str_prefixes_from_json, *default_tenant;

typedef struct {
    const char *start;
    size_t len;
} Span;

/* Where one attribute of one type lives: reading the slot directly skips PyObject_GetAttr's
 * type lookup and descriptor call (with 28 reads per request they were ~4 % of the service's
 * CPU). Valid while the type is the same object with the same version tag (a tag is never
 * reused, and any change to the type or its bases assigns a new one). */
typedef struct {
    PyTypeObject *type; /* compared, never dereferenced once stale */
    unsigned int version;
    Py_ssize_t offset; /* -1: use PyObject_GetAttr */
} SlotCache;

static SlotCache cache_sequences, cache_rank_list, cache_kv_reuse, cache_worker_id,
    cache_dp_rank, cache_prefill, cache_private, cache_requests, cache_blocks;

/* obj.name as a new reference (NULL with an error set). */
static PyObject *
slot_get(PyObject *obj, PyObject *name, SlotCache *c)
{
    PyTypeObject *t = Py_TYPE(obj);
    if (t != c->type || t->tp_version_tag != c->version ||
        !(t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) {
        c->type = NULL;
        c->offset = -1;
        PyObject *descr = _PyType_Lookup(t, name); /* borrowed; assigns a version tag */
        if ((t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) &&
            t->tp_getattro == PyObject_GenericGetAttr) {
            if (descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
                PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
                if (m->type == T_OBJECT_EX) {
                    c->offset = m->offset;
                }
            }
            c->type = t;
            c->version = t->tp_version_tag;
        }
    }
    if (c->offset >= 0) {
        PyObject *v = *(PyObject **)((char *)obj + c->offset);
        if (v != NULL) {
            return Py_NewRef(v);
        }
    }
    return PyObject_GetAttr(obj, name); /* also raises the AttributeError of an unset slot */
}

static inline const char *
skip_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) {
        p++;
    }
    return p;
}

/* A string of printable ASCII without escapes; p at its opening quote. NULL: not taken. */
static const char *
plain_string(const char *p, const char *end, Span *out)
{
    if (p >= end || *p != '"') {
        return NULL;
    }
    const char *s = ++p;
    while (p < end && *p != '"') {
        unsigned char c = (unsigned char)*p;
        if (c < 0x20 || c > 0x7e || c == '\\') {
            return NULL;
        }
        p++;
    }
    if (p >= end) {
        return NULL;
    }
    out->start = s;
    out->len = (size_t)(p - s);
    return p + 1;
}

typedef struct {
    Span model, tenant, hashes;
    int have_model, have_tenant, have_hashes, have_isl;
    long long isl;
} Body;

/* 1: the body is taken and described in *b; 0: leave it to the app. */
static int
parse_body(const char *p, const char *end, Body *b)
{
    memset(b, 0, sizeof(*b));
    p = skip_ws(p, end);
    if (p >= end || *p != '{') {
        return 0;
    }
    p = skip_ws(p + 1, end);
    for (;;) {
        Span key;
        p = plain_string(p, end, &key);
        if (p == NULL) {
            return 0;
        }
        p = skip_ws(p, end);
        if (p >= end || *p != ':') {
            return 0;
        }
        p = skip_ws(p + 1, end);
        if (key.len == 10 && memcmp(key.start, "model_name", 10) == 0 && !b->have_model) {
            p = plain_string(p, end, &b->model);
            b->have_model = 1;
        } else if (key.len == 9 && memcmp(key.start, "tenant_id", 9) == 0 && !b->have_tenant) {
            p = plain_string(p, end, &b->tenant);
            b->have_tenant = 1;
        } else if (key.len == 15 && memcmp(key.start, "sequence_hashes", 15) == 0 &&
                   !b->have_hashes) {
            if (p >= end || *p != '[') {
                return 0;
            }
            /* Up to the first ']': prefixes_from_json refuses the span unless it is an array of
             * integers (a ']' in a string or a nested array ends it early, and is refused). */
            const char *s = p;
            p = memchr(p, ']', (size_t)(end - p));
            if (p == NULL) {
                return 0;
            }
            p++;
            b->hashes.start = s;
            b->hashes.len = (size_t)(p - s);
            b->have_hashes = 1;
        } else if (key.len == 14 && memcmp(key.start, "new_isl_tokens", 14) == 0 &&
                   !b->have_isl) {
            const char *s = p;
            long long v = 0;
            while (p < end && *p >= '0' && *p <= '9' && p - s < 18) {
                v = v * 10 + (*p - '0');
                p++;
            }
            if (p == s || (*s == '0' && p - s > 1) || (p < end && *p >= '0' && *p <= '9')) {
                return 0;
            }
            b->isl = v;
            b->have_isl = 1;
        } else {
            return 0;
        }
        if (p == NULL) {
            return 0;
        }
        p = skip_ws(p, end);
        if (p < end && *p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (p < end && *p == '}') {
            break;
        }
        return 0;
    }
    return skip_ws(p + 1, end) == end && b->have_model && b->have_hashes;
}

/* ------------------------------------------------------------------ answer */

typedef struct {
    char *data;
    size_t len, cap;
} Out;

static int
out_grow(Out *o, size_t extra)
{
    if (o->len + extra <= o->cap) {
        return 0;
    }
    size_t cap = o->cap ? o->cap * 2 : 512;
    while (cap < o->len + extra) {
        cap *= 2;
    }
    char *grown = PyMem_Realloc(o->data, cap);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->data = grown;
    o->cap = cap;
    return 0;
}

/* A Python int as msgspec encodes it (-2**63 .. 2**64-1); -1 with an error set, 1 if out of
 * range (not taken). */
static int
int_value(PyObject *obj, __int128 *out)
{
    if (!PyLong_CheckExact(obj)) {
        return 1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow == 0) {
        *out = v;
        return 0;
    }
    if (overflow < 0) {
        return 1;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(obj);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    *out = (__int128)u;
    return 0;
}

static int
attr_value(PyObject *obj, PyObject *name, SlotCache *cache, __int128 *out)
{
    PyObject *v = slot_get(obj, name, cache);
    if (v == NULL) {
        return -1;
    }
    int rc = int_value(v, out);
    Py_DECREF(v);
    return rc;
}

/* Append `"name":value` (value within -2**63 .. 2**64-1, else 1: not taken). */
static int
out_member(Out *o, const char *name, __int128 v)
{
    if (v < -((__int128)1 << 63) || v > (__int128)UINT64_MAX) {
        return 1;
    }
    size_t name_len = strlen(name);
    if (out_grow(o, name_len + 32) < 0) {
        return -1;
    }
    char *w = o->data + o->len;
    *w++ = '"';
    memcpy(w, name, name_len);
    w += name_len;
    *w++ = '"';
    *w++ = ':';
    unsigned __int128 u = (unsigned __int128)v;
    if (v < 0) {
        *w++ = '-';
        u = (unsigned __int128)(-v);
    }
    char digits[24];
    int n = 0;
    uint64_t x = (uint64_t)u;
    do {
        digits[n++] = (char)('0' + x % 10);
        x /= 10;
    } while (x);
    while (n) {
        *w++ = digits[--n];
    }
    o->len = (size_t)(w - o->data);
    return 0;
}

/* One rank's entry; 1: not taken, -1: error. */
static int
out_rank(Out *o, PyObject *rank, PyObject *query, long long isl)
{
    __int128 worker, dp, prefill, private_blocks, requests, absent, held;
    int rc;
    if ((rc = attr_value(rank, str_worker_id, &cache_worker_id, &worker)) != 0 ||
        (rc = attr_value(rank, str_dp_rank, &cache_dp_rank, &dp)) != 0 ||
        (rc = attr_value(rank, str_prefill, &cache_prefill, &prefill)) != 0 ||
        (rc = attr_value(rank, str_private, &cache_private, &private_blocks)) != 0 ||
        (rc = attr_value(rank, str_requests, &cache_requests, &requests)) != 0) {
        return rc;
    }
    PyObject *blocks = slot_get(rank, str_blocks, &cache_blocks);
    if (blocks == NULL) {
        return -1;
    }
    Py_ssize_t size = PyObject_Size(blocks);
    PyObject *count = size < 0 ? NULL : PyObject_CallMethodOneArg(blocks, str_count_absent, query);
    Py_DECREF(blocks);
    if (count == NULL) {
        return -1;
    }
    rc = int_value(count, &absent);
    Py_DECREF(count);
    if (rc != 0) {
        return rc;
    }
    held = size;
    if (out_grow(o, 2) < 0) {
        return -1;
    }
    o->data[o->len++] = '{';
    if ((rc = out_member(o, "worker_id", worker)) != 0) {
        return rc;
    }
    o->data[o->len++] = ',';
    if ((rc = out_member(o, "dp_rank", dp)) != 0) {
        return rc;
    }
    o->data[o->len++] = ',';
    if ((rc = out_member(o, "potential_prefill_tokens", prefill + isl)) != 0) {
        return rc;
    }
    o->data[o->len++] = ',';
    if ((rc = out_member(o, "potential_decode_blocks", held + private_blocks + absent)) != 0) {
        return rc;
    }
    o->data[o->len++] = ',';
    if ((rc = out_member(o, "active_requests", requests)) != 0) {
        return rc;
    }
    if (out_grow(o, 2) < 0) {
        return -1;
    }
    o->data[o->len++] = '}';
    return 0;
}

/* The ranks of the tracker for the body's key (new reference), Py_None if not taken, NULL on
 * error. */
static PyObject *
rank_list(PyObject *trackers, const Body *b)
{
    PyObject *model = PyUnicode_DecodeASCII(b->model.start, (Py_ssize_t)b->model.len, NULL);
    if (model == NULL) {
        return NULL;
    }
    PyObject *tenant = b->have_tenant ? PyUnicode_DecodeASCII(b->tenant.start,
                                                              (Py_ssize_t)b->tenant.len, NULL)
                                      : Py_NewRef(default_tenant);
    if (tenant == NULL) {
        Py_DECREF(model);
        return NULL;
    }
    PyObject *key = PyTuple_Pack(2, model, tenant);
    Py_DECREF(model);
    Py_DECREF(tenant);
    if (key == NULL) {
        return NULL;
    }
    PyObject *tracker = PyDict_GetItemWithError(trackers, key); /* borrowed */
    Py_DECREF(key);
    if (tracker == NULL) {
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None); /* the app answers 404 */
    }
    PyObject *sequences = slot_get(tracker, str_sequences, &cache_sequences);
    if (sequences == NULL) {
        return NULL;
    }
    PyObject *reuse = slot_get(sequences, str_kv_reuse, &cache_kv_reuse);
    PyObject *ranks = reuse == NULL ? NULL : slot_get(sequences, str_rank_list, &cache_rank_list);
    Py_DECREF(sequences);
    if (ranks == NULL) {
        Py_XDECREF(reuse);
        return NULL;
    }
    int taken = reuse == Py_True && PyList_CheckExact(ranks);
    Py_DECREF(reuse);
    if (!taken) {
        Py_DECREF(ranks);
        return Py_NewRef(Py_None);
    }
    return ranks;
}

static PyObject *
potential_loads(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "potential_loads(trackers: dict, body: bytes)");
        return NULL;
    }
    PyObject *trackers = args[0], *data = args[1];
    const char *body = PyBytes_AS_STRING(data);
    Body b;
    if (!parse_body(body, body + PyBytes_GET_SIZE(data), &b)) {
        Py_RETURN_NONE;
    }
    PyObject *ranks = rank_list(trackers, &b);
    if (ranks == NULL || ranks == Py_None) {
        return ranks;
    }
    PyObject *result = NULL;
    PyObject *query = NULL;
    Out o = {NULL, 0, 0};
    if (PyList_GET_SIZE(ranks) == 0) { /* never for a tracker (it has a worker): the app's */
        Py_DECREF(ranks);
        Py_RETURN_NONE;
    }
    PyObject *first = PyList_GET_ITEM(ranks, 0);
    PyObject *view = PyMemoryView_FromMemory((char *)b.hashes.start, (Py_ssize_t)b.hashes.len,
                                             PyBUF_READ);
    if (view == NULL) {
        goto done;
    }
    /* The query's prefix keys, by the rank tables' own class (the app's BlockCounts). */
    PyObject *blocks = slot_get(first, str_blocks, &cache_blocks);
    if (blocks == NULL) {
        Py_DECREF(view);
        goto done;
    }
    query = PyObject_CallMethodOneArg((PyObject *)Py_TYPE(blocks), str_prefixes_from_json, view);
    Py_DECREF(blocks);
    Py_DECREF(view);
    if (query == NULL) {
        if (PyErr_ExceptionMatches(PyExc_ValueError)) { /* the app words the error */
            PyErr_Clear();
            result = Py_NewRef(Py_None);
        }
        goto done;
    }
    if (out_grow(&o, 2) < 0) {
        goto done;
    }
    o.data[o.len++] = '[';
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ranks); i++) {
        if (i) {
            if (out_grow(&o, 1) < 0) {
                goto done;
            }
            o.data[o.len++] = ',';
        }
        PyObject *rank = Py_NewRef(PyList_GET_ITEM(ranks, i)); /* held across calls out */
        int rc = out_rank(&o, rank, query, b.isl);
        Py_DECREF(rank);
        if (rc < 0) {
            goto done;
        }
        if (rc > 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    if (out_grow(&o, 1) < 0) {
        goto done;
    }
    o.data[o.len++] = ']';
    result = PyBytes_FromStringAndSize(o.data, (Py_ssize_t)o.len);
done:
    PyMem_Free(o.data);
    Py_XDECREF(query);
    Py_DECREF(ranks);
    return result;
}

static PyMethodDef module_methods[] = {
    {"potential_loads", (PyCFunction)(void (*)(void))potential_loads, METH_FASTCALL,
     "potential_loads(trackers, body) -> the 200 answer's bytes, or None: the app answers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef loads_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dynamo.slot_tracker._loads",
    .m_doc = "POST /potential_loads of the slot tracker, from body bytes to answer bytes.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__loads(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&str_sequences, "sequences"},
        {&str_rank_list, "_rank_list"},
        {&str_kv_reuse, "_assume_kv_reuse"},
        {&str_worker_id, "worker_id"},
        {&str_dp_rank, "dp_rank"},
        {&str_prefill, "prefill_tokens"},
        {&str_private, "private_blocks"},
        {&str_requests, "num_requests"},
        {&str_blocks, "blocks"},
        {&str_count_absent, "count_absent"},
        {&str_prefixes_from_json, "prefixes_from_json"},
        {&default_tenant, "default"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL) {
            return NULL;
        }
    }
    return PyModule_Create(&loads_module);
}

/*
 * dynamo.runtime._http: the native request path of the JSON servers (http_json.py).
 *
 * Why: with httptools every request of the slot tracker ran ~10 Python frames in the HTTP layer
 * alone (data_received, one callback per URL piece and header, headers/body/message complete,
 * then the response formatting): at ~40 us of CPU per request, the interpreter was 42 % of the
 * event loop thread. Dispatcher.feed parses the plain requests of a read, calls the app once per
 * request and renders the keep-alive answers, all in one C call.
 *
 * Contract: feed(data) handles the complete requests at the start of ``data`` that are on the
 * native path and returns ``(responses or None, bytes consumed, error or None)``; it stops at
 * the first request that is not, and the caller hands the rest (from that boundary on) to
 * httptools, which
 * then decides exactly as before: 400, 413, 431, 100-continue, chunked bodies, HEAD, a
 * "Connection" other than keep-alive, an incomplete request... The native path is a strict
 * subset of HTTP/1.1: "GET" or "POST", an origin-form target of RFC 3986 characters,
 * "HTTP/1.1", header names of token characters, values of visible ASCII, space and tab, at most
 * one Content-Length (digits, within max_body_bytes) and one Content-Type, no Transfer-Encoding,
 * Expect or Upgrade, the whole head within max_header_bytes and the whole body in ``data``.
 * Every request it takes is keep-alive, so every answer it renders is too.
 *
 * Answers: a fast route (``fast_routes``: POST path -> callable(body) -> JSON bytes or None),
 * tried only for a body sent as exactly "application/json", answers 200 with its bytes; None
 * (or any other request) goes to ``handle(method, path, query, content_type, body)``. A
 * ``(status, non-empty body)`` result whose status has a pre-rendered head in ``prefixes`` is
 * rendered here; any other result by ``render(result)``. A handler that raises stops feed(): it
 * returns the answers before that request and the exception (the caller answers 500 and closes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FAST_ROUTES 8

static unsigned char is_tchar[256];  /* header name characters (RFC 9110 token) */
static unsigned char is_target[256]; /* request-target characters (RFC 3986 pchar, '/', '?') */
static PyObject *method_get, *method_post, *empty_bytes;

typedef struct {
    PyObject_HEAD
    PyObject *handle;
    PyObject *render;
    PyObject *prefixes;  /* dict: status int -> bytes, the head up to the content-length value */
    PyObject *ok_prefix; /* prefixes[200] */
    Py_ssize_t max_head;
    Py_ssize_t max_body;
    Py_ssize_t n_fast;
    PyObject *fast_paths[MAX_FAST_ROUTES];
    PyObject *fast_handlers[MAX_FAST_ROUTES];
} Dispatcher;

typedef struct {
    int post;
    const char *target;
    size_t target_len;
    const char *ctype; /* NULL: no Content-Type */
    size_t ctype_len;
    const char *body;
    size_t body_len;
    size_t total; /* bytes of the whole request */
} Request;

static inline int
name_is(const char *name, size_t len, const char *lower, size_t lower_len)
{
    /* Token characters only: OR-ing 0x20 lowercases letters and maps no other token character
     * onto a letter, a digit or '-'. */
    if (len != lower_len) {
        return 0;
    }
    for (size_t i = 0; i < len; i++) {
        if (((unsigned char)name[i] | 0x20) != (unsigned char)lower[i]) {
            return 0;
        }
    }
    return 1;
}

#define NAME_IS(name, len, lit) name_is((name), (len), (lit), sizeof(lit) - 1)

/* 1: one complete request on the native path, described in *r; 0: leave it to httptools. */
static int
parse_request(const char *start, const char *end, Py_ssize_t max_head, Py_ssize_t max_body,
              Request *r)
{
    const char *limit = (end - start > max_head) ? start + max_head : end;
    const char *p = start;
    if (limit - p >= 5 && memcmp(p, "POST ", 5) == 0) {
        r->post = 1;
        p += 5;
    } else if (limit - p >= 4 && memcmp(p, "GET ", 4) == 0) {
        r->post = 0;
        p += 4;
    } else {
        return 0;
    }
    if (p >= limit || *p != '/') {
        return 0;
    }
    r->target = p;
    while (p < limit && is_target[(unsigned char)*p]) {
        p++;
    }
    r->target_len = (size_t)(p - r->target);
    if (limit - p < 11 || memcmp(p, " HTTP/1.1\r\n", 11) != 0) {
        return 0;
    }
    p += 11;
    r->ctype = NULL;
    r->ctype_len = 0;
    int have_length = 0;
    uint64_t length = 0;
    for (;;) {
        if (limit - p < 2) {
            return 0;
        }
        if (p[0] == '\r') {
            if (p[1] != '\n') {
                return 0;
            }
            p += 2;
            break;
        }
        const char *name = p;
        while (p < limit && is_tchar[(unsigned char)*p]) {
            p++;
        }
        size_t name_len = (size_t)(p - name);
        if (name_len == 0 || p >= limit || *p != ':') {
            return 0;
        }
        p++;
        while (p < limit && (*p == ' ' || *p == '\t')) {
            p++;
        }
        const char *value = p;
        while (p < limit && ((unsigned char)*p >= 0x20 && (unsigned char)*p < 0x7f)) {
            p++;
        }
        while (p < limit && *p == '\t') { /* rare: a tab inside a value, keep scanning */
            p++;
            while (p < limit && ((unsigned char)*p >= 0x20 && (unsigned char)*p < 0x7f)) {
                p++;
            }
        }
        if (limit - p < 2 || p[0] != '\r' || p[1] != '\n') {
            return 0;
        }
        const char *value_end = p;
        while (value_end > value && (value_end[-1] == ' ' || value_end[-1] == '\t')) {
            value_end--;
        }
        size_t value_len = (size_t)(value_end - value);
        p += 2;
        if (NAME_IS(name, name_len, "content-length")) {
            if (have_length || value_len == 0 || value_len > 19) {
                return 0;
            }
            for (size_t i = 0; i < value_len; i++) {
                if (value[i] < '0' || value[i] > '9') {
                    return 0;
                }
                length = length * 10 + (uint64_t)(value[i] - '0');
            }
            if (length > (uint64_t)max_body) {
                return 0; /* httptools answers 413 */
            }
            have_length = 1;
        } else if (NAME_IS(name, name_len, "content-type")) {
            if (r->ctype != NULL) {
                return 0;
            }
            r->ctype = value;
            r->ctype_len = value_len;
        } else if (NAME_IS(name, name_len, "connection")) {
            if (!NAME_IS(value, value_len, "keep-alive")) {
                return 0;
            }
        } else if (NAME_IS(name, name_len, "transfer-encoding") ||
                   NAME_IS(name, name_len, "expect") || NAME_IS(name, name_len, "upgrade")) {
            return 0;
        }
    }
    if ((uint64_t)(end - p) < length) {
        return 0; /* the body is not all here yet */
    }
    r->body = p;
    r->body_len = (size_t)length;
    r->total = (size_t)(p - start) + (size_t)length;
    return 1;
}

/* ------------------------------------------------------------------ output buffer */

typedef struct {
    char *data;
    size_t len, cap;
    char inline_buf[4096];
} Out;

static int
out_reserve(Out *o, size_t extra)
{
    if (o->len + extra <= o->cap) {
        return 0;
    }
    size_t cap = o->cap * 2;
    while (cap < o->len + extra) {
        cap *= 2;
    }
    char *grown = o->data == o->inline_buf ? PyMem_Malloc(cap) : PyMem_Realloc(o->data, cap);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (o->data == o->inline_buf) {
        memcpy(grown, o->inline_buf, o->len);
    }
    o->data = grown;
    o->cap = cap;
    return 0;
}

/* prefix + decimal length of payload + CRLF CRLF + payload */
static int
out_answer(Out *o, PyObject *prefix, PyObject *payload)
{
    Py_ssize_t prefix_len = PyBytes_GET_SIZE(prefix);
    Py_ssize_t payload_len = PyBytes_GET_SIZE(payload);
    char digits[24]; /* the length, right-aligned, then CRLF CRLF (snprintf cost ~1k cycles) */
    char *d = digits + sizeof(digits);
    memcpy(d -= 4, "\r\n\r\n", 4);
    size_t v = (size_t)payload_len;
    do {
        *--d = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    size_t n = (size_t)(digits + sizeof(digits) - d);
    if (out_reserve(o, (size_t)prefix_len + n + (size_t)payload_len) < 0) {
        return -1;
    }
    memcpy(o->data + o->len, PyBytes_AS_STRING(prefix), (size_t)prefix_len);
    o->len += (size_t)prefix_len;
    memcpy(o->data + o->len, d, n);
    o->len += n;
    memcpy(o->data + o->len, PyBytes_AS_STRING(payload), (size_t)payload_len);
    o->len += (size_t)payload_len;
    return 0;
}

static int
out_raw(Out *o, PyObject *bytes)
{
    if (!PyBytes_Check(bytes)) {
        PyErr_SetString(PyExc_TypeError, "render() must return bytes");
        return -1;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(bytes);
    if (out_reserve(o, (size_t)len) < 0) {
        return -1;
    }
    memcpy(o->data + o->len, PyBytes_AS_STRING(bytes), (size_t)len);
    o->len += (size_t)len;
    return 0;
}

/* ------------------------------------------------------------------ dispatch */

static int
render_result(Dispatcher *self, Out *o, PyObject *result)
{
    if (PyTuple_CheckExact(result) && PyTuple_GET_SIZE(result) == 2) {
        PyObject *payload = PyTuple_GET_ITEM(result, 1);
        if (PyBytes_CheckExact(payload) && PyBytes_GET_SIZE(payload) > 0) {
            PyObject *prefix = PyDict_GetItemWithError(self->prefixes, PyTuple_GET_ITEM(result, 0));
            if (prefix != NULL && PyBytes_CheckExact(prefix)) {
                return out_answer(o, prefix, payload);
            }
            if (PyErr_Occurred()) {
                return -1;
            }
        }
    }
    PyObject *rendered = PyObject_CallOneArg(self->render, result);
    if (rendered == NULL) {
        return -1;
    }
    int rc = out_raw(o, rendered);
    Py_DECREF(rendered);
    return rc;
}

static int
answer(Dispatcher *self, Out *o, const Request *r)
{
    const char *query = memchr(r->target, '?', r->target_len);
    size_t path_len = query == NULL ? r->target_len : (size_t)(query - r->target);
    PyObject *body = r->body_len ? PyBytes_FromStringAndSize(r->body, (Py_ssize_t)r->body_len)
                                 : Py_NewRef(empty_bytes);
    if (body == NULL) {
        return -1;
    }
    if (r->post && r->ctype_len == 16 && memcmp(r->ctype, "application/json", 16) == 0) {
        for (Py_ssize_t i = 0; i < self->n_fast; i++) {
            PyObject *route = self->fast_paths[i];
            if ((size_t)PyBytes_GET_SIZE(route) != path_len ||
                memcmp(PyBytes_AS_STRING(route), r->target, path_len) != 0) {
                continue;
            }
            PyObject *fast = PyObject_CallOneArg(self->fast_handlers[i], body);
            if (fast == NULL) {
                Py_DECREF(body);
                return -1;
            }
            if (PyBytes_CheckExact(fast) && PyBytes_GET_SIZE(fast) > 0) {
                int rc = out_answer(o, self->ok_prefix, fast);
                Py_DECREF(fast);
                Py_DECREF(body);
                return rc;
            }
            if (fast != Py_None) {
                Py_DECREF(fast);
                Py_DECREF(body);
                PyErr_SetString(PyExc_TypeError, "a fast route must return non-empty bytes or None");
                return -1;
            }
            Py_DECREF(fast);
            break;
        }
    }
    PyObject *args[5] = {r->post ? method_post : method_get, NULL, NULL, Py_None, body};
    args[1] = PyBytes_FromStringAndSize(r->target, (Py_ssize_t)path_len);
    args[2] = query == NULL ? Py_NewRef(empty_bytes)
                            : PyBytes_FromStringAndSize(query + 1,
                                                        (Py_ssize_t)(r->target_len - path_len - 1));
    if (r->ctype != NULL) {
        args[3] = PyBytes_FromStringAndSize(r->ctype, (Py_ssize_t)r->ctype_len);
    } else {
        Py_INCREF(Py_None);
    }
    PyObject *result = NULL;
    if (args[1] != NULL && args[2] != NULL && args[3] != NULL) {
        result = PyObject_Vectorcall(self->handle, args, 5, NULL);
    }
    Py_XDECREF(args[1]);
    Py_XDECREF(args[2]);
    Py_XDECREF(args[3]);
    Py_DECREF(body);
    if (result == NULL) {
        return -1;
    }
    int rc = render_result(self, o, result);
    Py_DECREF(result);
    return rc;
}

/* The raised exception as an object, with its traceback (PyErr_GetRaisedException is 3.12+). */
static PyObject *
take_exception(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL) {
        PyException_SetTraceback(value, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value != NULL ? value : Py_NewRef(Py_None);
}

static PyObject *
Dispatcher_feed(Dispatcher *self, PyObject *data)
{
    if (!PyBytes_Check(data)) {
        PyErr_Format(PyExc_TypeError, "feed() takes bytes, not %.100s", Py_TYPE(data)->tp_name);
        return NULL;
    }
    Py_INCREF(data); /* a handler must not be able to free the buffer under us */
    const char *base = PyBytes_AS_STRING(data);
    const char *end = base + PyBytes_GET_SIZE(data);
    const char *p = base;
    Out o;
    o.data = o.inline_buf;
    o.len = 0;
    o.cap = sizeof(o.inline_buf);
    PyObject *result = NULL;
    PyObject *error = NULL;
    while (p < end) {
        Request r;
        if (!parse_request(p, end, self->max_head, self->max_body, &r)) {
            break;
        }
        if (answer(self, &o, &r) < 0) {
            error = take_exception();
            break;
        }
        p += r.total;
    }
    PyObject *out;
    if (o.len) {
        out = PyBytes_FromStringAndSize(o.data, (Py_ssize_t)o.len);
        if (out == NULL) {
            Py_XDECREF(error);
            goto done;
        }
    } else {
        out = Py_NewRef(Py_None);
    }
    if (error == NULL) {
        error = Py_NewRef(Py_None);
    }
    PyObject *used = PyLong_FromSsize_t((Py_ssize_t)(p - base));
    if (used != NULL) {
        result = PyTuple_Pack(3, out, used, error);
        Py_DECREF(used);
    }
    Py_DECREF(out);
    Py_DECREF(error);
done:
    if (o.data != o.inline_buf) {
        PyMem_Free(o.data);
    }
    Py_DECREF(data);
    return result;
}

/* ------------------------------------------------------------------ type */

static int
Dispatcher_init(Dispatcher *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"handle",          "render",         "prefixes", "fast_routes",
                             "max_header_bytes", "max_body_bytes", NULL};
    PyObject *handle, *render, *prefixes, *fast;
    Py_ssize_t max_head, max_body;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!O!nn", kwlist, &handle, &render,
                                     &PyDict_Type, &prefixes, &PyDict_Type, &fast, &max_head,
                                     &max_body)) {
        return -1;
    }
    if (max_head < 1 || max_body < 0) {
        PyErr_SetString(PyExc_ValueError, "limits must be positive");
        return -1;
    }
    if (PyDict_GET_SIZE(fast) > MAX_FAST_ROUTES) {
        PyErr_Format(PyExc_ValueError, "at most %d fast routes", MAX_FAST_ROUTES);
        return -1;
    }
    PyObject *two_hundred = PyLong_FromLong(200);
    if (two_hundred == NULL) {
        return -1;
    }
    PyObject *ok = PyDict_GetItemWithError(prefixes, two_hundred);
    Py_DECREF(two_hundred);
    if (ok == NULL || !PyBytes_CheckExact(ok)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "prefixes must map 200 to bytes");
        }
        return -1;
    }
    Py_ssize_t pos = 0, n = 0;
    PyObject *key, *value;
    while (PyDict_Next(fast, &pos, &key, &value)) {
        if (!PyBytes_CheckExact(key) || !PyCallable_Check(value)) {
            PyErr_SetString(PyExc_TypeError, "fast_routes maps bytes paths to callables");
            return -1;
        }
    }
    pos = 0;
    while (PyDict_Next(fast, &pos, &key, &value)) {
        Py_XSETREF(self->fast_paths[n], Py_NewRef(key));
        Py_XSETREF(self->fast_handlers[n], Py_NewRef(value));
        n++;
    }
    self->n_fast = n;
    Py_XSETREF(self->handle, Py_NewRef(handle));
    Py_XSETREF(self->render, Py_NewRef(render));
    Py_XSETREF(self->prefixes, Py_NewRef(prefixes));
    Py_XSETREF(self->ok_prefix, Py_NewRef(ok));
    self->max_head = max_head;
    self->max_body = max_body;
    return 0;
}

static int
Dispatcher_traverse(Dispatcher *self, visitproc visit, void *arg)
{
    Py_VISIT(self->handle);
    Py_VISIT(self->render);
    Py_VISIT(self->prefixes);
    Py_VISIT(self->ok_prefix);
    for (Py_ssize_t i = 0; i < MAX_FAST_ROUTES; i++) {
        Py_VISIT(self->fast_paths[i]);
        Py_VISIT(self->fast_handlers[i]);
    }
    return 0;
}

static int
Dispatcher_clear(Dispatcher *self)
{
    Py_CLEAR(self->handle);
    Py_CLEAR(self->render);
    Py_CLEAR(self->prefixes);
    Py_CLEAR(self->ok_prefix);
    for (Py_ssize_t i = 0; i < MAX_FAST_ROUTES; i++) {
        Py_CLEAR(self->fast_paths[i]);
        Py_CLEAR(self->fast_handlers[i]);
    }
    self->n_fast = 0;
    return 0;
}

static void
Dispatcher_dealloc(Dispatcher *self)
{
    PyObject_GC_UnTrack(self);
    Dispatcher_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Dispatcher_call_feed(Dispatcher *self, PyObject *data)
{
    if (self->handle == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Dispatcher not initialised");
        return NULL;
    }
    return Dispatcher_feed(self, data);
}

static PyMethodDef Dispatcher_methods[] = {
    {"feed", (PyCFunction)Dispatcher_call_feed, METH_O,
     "feed(data) -> (responses or None, bytes consumed, handler error or None): answer the "
     "complete plain requests at the start of data; the rest, from a request boundary, is the "
     "caller's (httptools)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DispatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dynamo.runtime._http.Dispatcher",
    .tp_doc = PyDoc_STR("Dispatcher(handle, render, prefixes, fast_routes, max_header_bytes, "
                        "max_body_bytes): the native request path (contract: _http.c)."),
    .tp_basicsize = sizeof(Dispatcher),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Dispatcher_init,
    .tp_dealloc = (destructor)Dispatcher_dealloc,
    .tp_traverse = (traverseproc)Dispatcher_traverse,
    .tp_clear = (inquiry)Dispatcher_clear,
    .tp_methods = Dispatcher_methods,
};

static struct PyModuleDef http_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dynamo.runtime._http",
    .m_doc = "Native request path of the JSON servers (runtime/http_json.py).",
    .m_size = -1,
};

static void
init_tables(void)
{
    const char *tchar_extra = "!#$%&'*+-.^_`|~";
    const char *target_extra = "-._~!$&'()*+,;=:@/?%";
    for (int c = 0; c < 256; c++) {
        int alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        is_tchar[c] = alnum || (c && strchr(tchar_extra, c) != NULL);
        is_target[c] = alnum || (c && strchr(target_extra, c) != NULL);
    }
}

PyMODINIT_FUNC
PyInit__http(void)
{
    init_tables();
    if (PyType_Ready(&DispatcherType) < 0) {
        return NULL;
    }
    method_get = PyBytes_FromString("GET");
    method_post = PyBytes_FromString("POST");
    empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
    if (method_get == NULL || method_post == NULL || empty_bytes == NULL) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&http_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&DispatcherType);
    if (PyModule_AddObject(module, "Dispatcher", (PyObject *)&DispatcherType) < 0) {
        Py_DECREF(&DispatcherType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

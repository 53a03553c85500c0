/*
 * dynamo/router/_radix_api.h: the native prefix tree's calls for C callers, as a capsule
 * ``dynamo.router._radix._C_API`` (a DynRadixApi), so that the KV indexer's in-order applier
 * (``_apply_raw.c``) applies a pass's raw events buffer without a method call and the tuple of
 * three counts it returns (~2.4 buffers a request in the offline replay).
 *
 * Each function takes an instance of ``type`` (the native ``RadixTree``) and does exactly what
 * its method does. A caller with any other tree (the Python twin) calls the methods.
 */
#ifndef DYNAMO_RADIX_API_H
#define DYNAMO_RADIX_API_H

#include <Python.h>

#define DYN_RADIX_API_CAPSULE "dynamo.router._radix._C_API"

typedef struct {
    PyTypeObject *type;
    /* apply_raw(slot, raw): 0 with counts set to its (ok, parent, block), or -1 with its error */
    int (*apply_raw)(PyObject *tree, PyObject *slot, PyObject *raw, Py_ssize_t counts[3]);
} DynRadixApi;

#endif

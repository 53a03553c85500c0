/*
 * dynamo/engine_core/_frozen.h: whether an object is an instance of a frozen dataclass, for
 * the native modules that keep the values they read from a config while they hold it (its
 * identity then says its values: the scheduler pass's limits in ``_pass.c``, a request's
 * checks in ``_sequence.c``; the mocker's and the replay's ``MockerConfig`` is one).
 */
#ifndef DYNAMO_FROZEN_H
#define DYNAMO_FROZEN_H

#include <Python.h>

/* 1 if ``obj`` is an instance of a frozen dataclass, 0 if not (no error). */
static inline int
dyn_frozen_dataclass(PyObject *obj)
{
    PyObject *params = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__dataclass_params__");
    PyObject *frozen = params ? PyObject_GetAttrString(params, "frozen") : NULL;
    int t = frozen ? PyObject_IsTrue(frozen) : 0;
    Py_XDECREF(params);
    Py_XDECREF(frozen);
    PyErr_Clear();
    return t > 0;
}

#endif

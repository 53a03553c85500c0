/*
 * dynamo/_import.h: ``module.name`` for the native modules that look up a Python-level object
 * at import or at a run's start (CPython 3.11 has no ``PyImport_ImportModuleAttrString``).
 */
#ifndef DYNAMO_IMPORT_H
#define DYNAMO_IMPORT_H

#include <Python.h>

/* ``module``'s attribute ``name``: a new reference, or NULL with an exception. */
static inline PyObject *
dyn_import_attr(const char *module, const char *name)
{
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL)
        return NULL;
    PyObject *attr = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return attr;
}

#endif /* DYNAMO_IMPORT_H */

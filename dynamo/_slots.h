/*
 * dynamo/_slots.h: a slotted class's fields read and written at their offsets, for the native
 * modules that walk Python objects of slotted classes (the scheduler pass's Sequence in
 * ``engine_core/_pass.c``; the replay's ranks, flights and records in ``replay/_deliver.c``,
 * ``replay/_loop.c``).
 *
 * Why: a field of a ``@dataclass(slots=True)`` is a member descriptor; reaching it through
 * ``PyObject_GetAttr`` costs a type lookup and a descriptor call (~30-40 ns), a load at its
 * offset a few. ``DynSlots`` learns the offsets of a list of field names once, from the first
 * class it meets whose fields are all plain writable object slots (``T_OBJECT_EX``); an object
 * of any other class (a subclass included) goes through getattr / setattr, with the same
 * results, so the fast path is an optimisation only. An unset slot raises AttributeError, as
 * the attribute access does.
 */
#ifndef DYNAMO_SLOTS_H
#define DYNAMO_SLOTS_H

#include <Python.h>
#include <structmember.h>
#include <string.h>

#define DYN_SLOTS_MAX 32 /* the most fields one DynSlots reads (the pass: 25 of the Sequence) */

typedef struct {
    const char *const *texts;  /* the field names */
    int n;                     /* how many (at most DYN_SLOTS_MAX) */
    PyObject *names[DYN_SLOTS_MAX]; /* interned by dyn_slots_init */
    PyTypeObject *type;        /* the learned class (strong), NULL until learned */
    PyTypeObject *refused;     /* the last class that is not plain slots (strong) */
    Py_ssize_t offsets[DYN_SLOTS_MAX];
} DynSlots;

/* A ``DynSlots`` for the array of field names ``fields``. */
#define DYN_SLOTS_OF(fields) {.texts = (fields), .n = (int)(sizeof(fields) / sizeof((fields)[0]))}

/* Intern the names (at module init): 0, or -1 with an exception. */
static int
dyn_slots_init(DynSlots *l)
{
    if (l->n > DYN_SLOTS_MAX) {
        PyErr_SetString(PyExc_SystemError, "DynSlots: more fields than DYN_SLOTS_MAX");
        return -1;
    }
    for (int k = 0; k < l->n; k++)
        if (l->names[k] == NULL && (l->names[k] = PyUnicode_InternFromString(l->texts[k])) == NULL)
            return -1;
    return 0;
}

/* Learn ``type``'s offsets if none are known yet and all its fields are plain writable object
 * slots; otherwise remember it as refused (its objects take the attribute path). */
static void
dyn_slots_learn(DynSlots *l, PyTypeObject *type)
{
    if (l->type != NULL || type == l->refused)
        return;
    Py_ssize_t found[DYN_SLOTS_MAX];
    for (int k = 0; k < l->n; k++) {
        PyObject *d = PyObject_GetAttr((PyObject *)type, l->names[k]);
        if (d == NULL) {
            PyErr_Clear();
            goto refuse;
        }
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type);
        if (ok) {
            PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
            ok = m->type == T_OBJECT_EX && !(m->flags & READONLY);
            found[k] = m->offset;
        }
        Py_DECREF(d);
        if (!ok)
            goto refuse;
    }
    memcpy(l->offsets, found, sizeof(Py_ssize_t) * (size_t)l->n);
    l->type = (PyTypeObject *)Py_NewRef(type);
    return;
refuse:
    Py_XSETREF(l->refused, (PyTypeObject *)Py_NewRef(type));
}

/* ``obj.<field f>`` (a new reference), or NULL with an exception. */
static inline PyObject *
dyn_slots_get(DynSlots *l, PyObject *obj, int f)
{
    if (Py_TYPE(obj) != l->type) {
        dyn_slots_learn(l, Py_TYPE(obj));
        if (Py_TYPE(obj) != l->type)
            return PyObject_GetAttr(obj, l->names[f]);
    }
    PyObject *v = *(PyObject **)((char *)obj + l->offsets[f]);
    if (v == NULL) {
        PyErr_Format(PyExc_AttributeError, "%U", l->names[f]);
        return NULL;
    }
    return Py_NewRef(v);
}

/* ``obj.<field f> = v`` (``v`` not stolen): 0, or -1 with an exception. */
static inline int
dyn_slots_put(DynSlots *l, PyObject *obj, int f, PyObject *v)
{
    if (Py_TYPE(obj) != l->type) {
        dyn_slots_learn(l, Py_TYPE(obj));
        if (Py_TYPE(obj) != l->type)
            return PyObject_SetAttr(obj, l->names[f], v);
    }
    PyObject **slot = (PyObject **)((char *)obj + l->offsets[f]);
    PyObject *old = *slot;
    *slot = Py_NewRef(v);
    Py_XDECREF(old);
    return 0;
}

#endif

/*
 * dynamo.engine_core._sequence: an object of a slotted class built from its slot values, at
 * their offsets, without its ``__init__`` (``engine_core.sequence.new_sequence``: one
 * ``Sequence`` per request, live in the mocker and in the offline replay).
 *
 * Why native: the ``Sequence`` dataclass's generated ``__init__`` takes 26 fields by keyword
 * and its ``__post_init__`` runs on every request (~1.6 µs a sequence, about 1 % of the
 * offline replay's CPU); storing 26 pointers costs a fraction of that. The caller computes
 * every value as ``__init__`` and ``__post_init__`` would (tests/unit/engine_core/
 * test_sequence_native.py holds the two constructions to the same fields).
 *
 * The slots are the class's ``__slots__`` in order (a ``@dataclass(slots=True)``'s field
 * order), each a plain writable object slot; their offsets are learned once per class (the
 * last class seen), any other class is refused with TypeError. The contract is
 * ``_sequence.pyi``; ``_sequence_fallback.py`` is the same in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define MAX_SLOTS 64

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

static PyMethodDef module_methods[] = {
    {"build", (PyCFunction)(void (*)(void))build, METH_FASTCALL,
     "build(cls, values): an object of the slotted class cls, its slots set to values."},
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
    return PyModule_Create(&sequence_module);
}

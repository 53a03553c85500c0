/*
 * dynamo.bench._draw: ``random.Random.choices(population, k=k)`` (uniform, no weights) with the
 * same draws and the same result, for the workloads' random words.
 *
 * Why native: every synthetic prompt is random words; ``random.choices`` spends ~100 ns per
 * word in its list comprehension (a ``random()`` call, a ``floor`` call, an index), which was
 * ~4 % of the offline replay's CPU (docs/performance.md, "Offline replay"), and the live
 * ``dynamo bench`` builds its prompts the same way. Here each word is ``population[floor(
 * random() * n)]`` with ``random()`` the generator's own C method called directly when it is
 * the built-in one (a subclass overriding ``random`` is called through Python), so the values
 * and the generator's state afterwards are exactly those of ``random.choices``.
 *
 * The contract is ``_draw.pyi``; ``_draw_fallback.py`` is the same in Python (``dynamo.native``
 * picks one) and tests/unit/bench/test_draw_native.py holds the two to the same outputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

static PyObject *s_random;

static PyObject *
choices(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "choices(rng, population, k)");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[2]);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    if (k < 0)
        k = 0; /* as random.choices: range(k) of a negative k is empty */
    PyObject *pop = PySequence_Fast(args[1], "population must be a sequence");
    if (pop == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(pop);
    PyObject *bound = PyObject_GetAttr(args[0], s_random);
    PyObject *out = NULL;
    if (bound == NULL)
        goto done;
    /* the built-in _random.Random.random: call its C function, skipping the method call */
    PyCFunction direct = NULL;
    PyObject *self = NULL;
    if (PyCFunction_Check(bound) && (PyCFunction_GET_FLAGS(bound) & METH_NOARGS)) {
        direct = PyCFunction_GET_FUNCTION(bound);
        self = PyCFunction_GET_SELF(bound);
    }
    out = PyList_New(k);
    if (out == NULL)
        goto done;
    double fn = (double)n;
    PyObject *const *items = PySequence_Fast_ITEMS(pop);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *r = direct ? direct(self, NULL) : PyObject_CallNoArgs(bound);
        if (r == NULL)
            goto fail;
        double x = PyFloat_AsDouble(r);
        Py_DECREF(r);
        if (x == -1.0 && PyErr_Occurred())
            goto fail;
        double f = floor(x * fn);
        if (!(f >= 0.0 && f < fn)) { /* random() outside [0, 1), or an empty population */
            PyErr_SetString(PyExc_IndexError, n ? "list index out of range"
                                                : "Cannot choose from an empty sequence");
            goto fail;
        }
        PyObject *item = items[(Py_ssize_t)f];
        Py_INCREF(item);
        PyList_SET_ITEM(out, i, item);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(bound);
    Py_DECREF(pop);
    return out;
}

static PyMethodDef methods[] = {
    {"choices", (PyCFunction)(void (*)(void))choices, METH_FASTCALL,
     "choices(rng, population, k): rng.choices(population, k=k) (contract: _draw.pyi)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_draw",
    "Uniform random draws for the workloads (contract: _draw.pyi; fallback: _draw_fallback.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__draw(void)
{
    s_random = PyUnicode_InternFromString("random");
    if (s_random == NULL)
        return NULL;
    return PyModule_Create(&module);
}

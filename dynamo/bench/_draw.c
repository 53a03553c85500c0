/*
 * dynamo.bench._draw: ``random.Random.choices(population, k=k)`` (uniform, no weights) with the
 * same draws and the same result, for the workloads' random words, and ``extended``: a
 * token-id prompt (a head of words, then drawn words up to its length) as one new list.
 *
 * Why native: every synthetic prompt is random words; ``random.choices`` spends ~100 ns per
 * word in its list comprehension (a ``random()`` call, a ``floor`` call, an index), which was
 * ~4 % of the offline replay's CPU (docs/performance.md, "Offline replay"), and the live
 * ``dynamo bench`` builds its prompts the same way. Here each word is ``population[floor(
 * random() * n)]``. ``random()`` of the built-in generator is computed in place from its
 * Mersenne Twister state (``mt_random`` below: CPython's ``_random.Random.random`` step for step,
 * no float object per draw); the module checks at import that this gives the generator's own
 * values and state on this interpreter, and calls the generator's C method otherwise. A
 * subclass overriding ``random`` is called through Python. So the values and the generator's
 * state afterwards are exactly those of ``random.choices``.
 *
 * The contract is ``_draw.pyi``; ``_draw_fallback.py`` is the same in Python (``dynamo.native``
 * picks one) and tests/unit/bench/test_draw_native.py holds the two to the same outputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../_import.h"

/* CPython's ``_random.Random`` object (Modules/_randommodule.c, 3.11-3.13): the generator's
 * state. Used only for objects whose ``random`` is the built-in method (``mt_func``), and only
 * after ``check_layout`` found it to give the method's own results. */
#define MT_N 624
#define MT_M 397
typedef struct {
    PyObject_HEAD
    int index;
    uint32_t state[MT_N];
} MTObject;

static PyObject *s_random;
static PyCFunction mt_func; /* _random.Random.random's C function; NULL: not in place */

/* The state's next N words (genrand_uint32's regeneration, MT19937). */
static void
mt_refill(MTObject *self)
{
    static const uint32_t mag01[2] = {0x0U, 0x9908b0dfU};
    uint32_t y, *mt = self->state;
    int kk;
    for (kk = 0; kk < MT_N - MT_M; kk++) {
        y = (mt[kk] & 0x80000000U) | (mt[kk + 1] & 0x7fffffffU);
        mt[kk] = mt[kk + MT_M] ^ (y >> 1) ^ mag01[y & 0x1U];
    }
    for (; kk < MT_N - 1; kk++) {
        y = (mt[kk] & 0x80000000U) | (mt[kk + 1] & 0x7fffffffU);
        mt[kk] = mt[kk + (MT_M - MT_N)] ^ (y >> 1) ^ mag01[y & 0x1U];
    }
    y = (mt[MT_N - 1] & 0x80000000U) | (mt[0] & 0x7fffffffU);
    mt[MT_N - 1] = mt[MT_M - 1] ^ (y >> 1) ^ mag01[y & 0x1U];
    self->index = 0;
}

/* genrand_uint32 of _randommodule.c (MT19937): the next output, tempered. */
static inline uint32_t
mt_next(MTObject *self)
{
    if (self->index >= MT_N) /* generate N words at one time */
        mt_refill(self);
    uint32_t y = self->state[self->index++];
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= (y >> 18);
    return y;
}

/* random_random of _randommodule.c: 53 random bits as a double in [0, 1). */
static inline double
mt_random(MTObject *self)
{
    uint32_t a = mt_next(self) >> 5, b = mt_next(self) >> 6;
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
}

/* How ``rng.random()`` is drawn: in place (``mt``), through the built-in C function
 * (``direct``), or by calling ``bound`` (a Python override). */
typedef struct {
    PyObject *bound;
    PyCFunction direct;
    PyObject *self;
    MTObject *mt;
} Source;

static int
source_open(Source *src, PyObject *rng)
{
    src->direct = NULL;
    src->self = NULL;
    src->mt = NULL;
    if ((src->bound = PyObject_GetAttr(rng, s_random)) == NULL)
        return -1;
    if (PyCFunction_Check(src->bound) && (PyCFunction_GET_FLAGS(src->bound) & METH_NOARGS)) {
        src->direct = PyCFunction_GET_FUNCTION(src->bound);
        src->self = PyCFunction_GET_SELF(src->bound);
        if (mt_func != NULL && src->direct == mt_func && src->self != NULL)
            src->mt = (MTObject *)src->self;
    }
    return 0;
}

/* One ``random()``: 0, or -1 with an exception. */
static int
source_draw(Source *src, double *x)
{
    if (src->mt != NULL) {
        *x = mt_random(src->mt);
        return 0;
    }
    PyObject *r = src->direct ? src->direct(src->self, NULL) : PyObject_CallNoArgs(src->bound);
    if (r == NULL)
        return -1;
    *x = PyFloat_AsDouble(r);
    Py_DECREF(r);
    return (*x == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* Fill ``out[start:start + k]`` with uniform draws from ``items[:n]``: 0, or -1 with an
 * exception (the unfilled places stay NULL: the caller drops the list). */
static int
draw_into(PyObject *rng, PyObject *out, Py_ssize_t start, Py_ssize_t k, PyObject *const *items,
          Py_ssize_t n)
{
    if (k <= 0)
        return 0;
    Source src;
    if (source_open(&src, rng) < 0)
        return -1;
    int rc = -1;
    double fn = (double)n;
    Py_ssize_t i = 0;
    if (src.mt != NULL) { /* in place: the same values, no call and no float object a word */
        for (; i < k; i++) {
            double f = mt_random(src.mt) * fn; /* >= 0: truncation is floor */
            if (!(f < fn))
                break; /* an empty population, or a product rounded up to n */
            PyObject *item = items[(Py_ssize_t)f];
            Py_INCREF(item);
            PyList_SET_ITEM(out, start + i, item);
        }
        if (i < k) { /* the draw just made was out of range, as random.choices finds it */
            PyErr_SetString(PyExc_IndexError, n ? "list index out of range"
                                                : "Cannot choose from an empty sequence");
            goto end;
        }
    }
    for (; i < k; i++) {
        double x;
        if (source_draw(&src, &x) < 0)
            goto end;
        double f = floor(x * fn);
        if (!(f >= 0.0 && f < fn)) { /* random() outside [0, 1), or an empty population */
            PyErr_SetString(PyExc_IndexError, n ? "list index out of range"
                                                : "Cannot choose from an empty sequence");
            goto end;
        }
        PyObject *item = items[(Py_ssize_t)f];
        Py_INCREF(item);
        PyList_SET_ITEM(out, start + i, item);
    }
    rc = 0;
end:
    Py_DECREF(src.bound);
    return rc;
}

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
    PyObject *out = NULL, *bound = NULL;
    if (k == 0) { /* random.choices looks the method up even for no draw */
        if ((bound = PyObject_GetAttr(args[0], s_random)) != NULL)
            out = PyList_New(0);
    }
    else if ((out = PyList_New(k)) != NULL &&
             draw_into(args[0], out, 0, k, PySequence_Fast_ITEMS(pop),
                       PySequence_Fast_GET_SIZE(pop)) < 0)
        Py_CLEAR(out);
    Py_XDECREF(bound);
    Py_DECREF(pop);
    return out;
}

/* ``extended``'s and ``packed``'s four arguments checked and their ``total`` read: the length,
 * or -1 with an exception. */
static Py_ssize_t
prompt_total(PyObject *const *args, Py_ssize_t nargs, const char *signature)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, signature);
        return -1;
    }
    Py_ssize_t total = PyLong_AsSsize_t(args[3]);
    if (total < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "a prompt's length cannot be negative");
    return total < 0 ? -1 : total;
}

/* extended(rng, population, head, total): ``head[:total]`` then ``total - len(head)`` draws. */
static PyObject *
extended(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t total = prompt_total(args, nargs, "extended(rng, population, head, total)");
    if (total < 0)
        return NULL;
    PyObject *head = PySequence_Fast(args[2], "the head must be a sequence");
    if (head == NULL)
        return NULL;
    PyObject *pop = NULL, *out = NULL;
    Py_ssize_t kept = PySequence_Fast_GET_SIZE(head);
    if (kept > total)
        kept = total;
    if ((pop = PySequence_Fast(args[1], "population must be a sequence")) == NULL ||
        (out = PyList_New(total)) == NULL)
        goto end;
    PyObject *const *words = PySequence_Fast_ITEMS(head);
    for (Py_ssize_t i = 0; i < kept; i++) {
        Py_INCREF(words[i]);
        PyList_SET_ITEM(out, i, words[i]);
    }
    if (total > kept && draw_into(args[0], out, kept, total - kept, PySequence_Fast_ITEMS(pop),
                                  PySequence_Fast_GET_SIZE(pop)) < 0)
        Py_CLEAR(out);
end:
    Py_XDECREF(pop);
    Py_DECREF(head);
    return out;
}

/* ``draw_into``'s draws as u32 ids into ``out[0:k]``, the population given as u32 ids too
 * (``words``: ``n`` of them): 0, or -1 with an exception. */
static int
draw_ids(PyObject *rng, uint32_t *out, Py_ssize_t k, const uint32_t *words, Py_ssize_t n)
{
    if (k <= 0)
        return 0;
    Source src;
    if (source_open(&src, rng) < 0)
        return -1;
    int rc = -1;
    double fn = (double)n;
    Py_ssize_t i = 0;
    if (src.mt != NULL) { /* in place, as draw_into */
        for (; i < k; i++) {
            double f = mt_random(src.mt) * fn; /* >= 0: truncation is floor */
            if (!(f < fn))
                break;
            out[i] = words[(Py_ssize_t)f];
        }
        if (i < k) {
            PyErr_SetString(PyExc_IndexError, n ? "list index out of range"
                                                : "Cannot choose from an empty sequence");
            goto end;
        }
    }
    for (; i < k; i++) {
        double x;
        if (source_draw(&src, &x) < 0)
            goto end;
        double f = floor(x * fn);
        if (!(f >= 0.0 && f < fn)) {
            PyErr_SetString(PyExc_IndexError, n ? "list index out of range"
                                                : "Cannot choose from an empty sequence");
            goto end;
        }
        out[i] = words[(Py_ssize_t)f];
    }
    rc = 0;
end:
    Py_DECREF(src.bound);
    return rc;
}

/* Whether ``obj``'s buffer is u32 ids (format "I"): 1 with *view held, else 0 with a
 * TypeError naming ``what``. */
static int
u32_view(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be an array('I')", what);
        return 0;
    }
    if (view->itemsize == 4 && view->format != NULL && strcmp(view->format, "I") == 0)
        return 1;
    PyBuffer_Release(view);
    PyErr_Format(PyExc_TypeError, "%s must be an array('I')", what);
    return 0;
}

static PyObject *array_type; /* array.array */

/* packed(rng, words, head, total): ``extended``'s prompt as an ``array('I')``; ``words`` (the
 * population) and ``head`` (a group's words) are ``array('I')``s, packed once. */
static PyObject *
packed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t total = prompt_total(args, nargs, "packed(rng, words, head, total)");
    if (total < 0)
        return NULL;
    Py_buffer words, head;
    if (!u32_view(args[1], &words, "the words"))
        return NULL;
    if (!u32_view(args[2], &head, "the head")) {
        PyBuffer_Release(&words);
        return NULL;
    }
    PyObject *bytes = NULL, *out = NULL;
    Py_ssize_t kept = head.len / 4;
    if (kept > total)
        kept = total;
    if ((bytes = PyBytes_FromStringAndSize(NULL, total * 4)) == NULL)
        goto end;
    uint32_t *ids = (uint32_t *)PyBytes_AS_STRING(bytes);
    memcpy(ids, head.buf, (size_t)kept * 4);
    if (draw_ids(args[0], ids + kept, total - kept, words.buf, words.len / 4) < 0)
        goto end;
    out = PyObject_CallFunction(array_type, "sO", "I", bytes); /* the ids as machine words */
end:
    PyBuffer_Release(&words);
    PyBuffer_Release(&head);
    Py_XDECREF(bytes);
    return out;
}

/* Whether ``mt_random`` reproduces the built-in generator on this interpreter: two generators
 * of one seed, one drawn in place and one through its method, past two regenerations of the
 * state, must give the same values and the same ``getstate()``. 1, 0 or -1. */
static int
check_layout(PyObject *random_type)
{
    PyObject *seed = PyLong_FromLong(20261126), *a = NULL, *b = NULL, *sa = NULL, *sb = NULL;
    int ok = -1;
    if (seed == NULL || (a = PyObject_CallOneArg(random_type, seed)) == NULL ||
        (b = PyObject_CallOneArg(random_type, seed)) == NULL)
        goto end;
    if (Py_TYPE(a)->tp_basicsize < (Py_ssize_t)sizeof(MTObject)) {
        ok = 0;
        goto end;
    }
    Source src;
    if (source_open(&src, b) < 0)
        goto end;
    ok = 1;
    for (int i = 0; i < 2 * MT_N && ok == 1; i++) {
        double x, y;
        if (source_draw(&src, &y) < 0)
            ok = -1;
        else {
            x = mt_random((MTObject *)a);
            ok = x == y;
        }
    }
    Py_DECREF(src.bound);
    if (ok != 1)
        goto end;
    if ((sa = PyObject_CallMethod(a, "getstate", NULL)) == NULL ||
        (sb = PyObject_CallMethod(b, "getstate", NULL)) == NULL)
        ok = -1;
    else
        ok = PyObject_RichCompareBool(sa, sb, Py_EQ);
end:
    Py_XDECREF(seed);
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(sa);
    Py_XDECREF(sb);
    return ok;
}

/* Find ``_random.Random.random``'s C function and keep it if ``check_layout`` passes. */
static int
init_in_place(void)
{
    PyObject *mod = PyImport_ImportModule("_random");
    if (mod == NULL)
        return -1;
    PyObject *type = PyObject_GetAttrString(mod, "Random"), *probe = NULL, *bound = NULL;
    Py_DECREF(mod);
    int rc = -1;
    if (type == NULL || (probe = PyObject_CallNoArgs(type)) == NULL ||
        (bound = PyObject_GetAttr(probe, s_random)) == NULL)
        goto end;
    rc = 0;
    if (PyCFunction_Check(bound) && (PyCFunction_GET_FLAGS(bound) & METH_NOARGS) &&
        PyType_Check(type) && ((PyTypeObject *)type)->tp_basicsize == (Py_ssize_t)sizeof(MTObject)) {
        mt_func = PyCFunction_GET_FUNCTION(bound);
        int ok = check_layout(type);
        if (ok != 1)
            mt_func = NULL;
        rc = ok < 0 ? -1 : 0;
    }
end:
    Py_XDECREF(type);
    Py_XDECREF(probe);
    Py_XDECREF(bound);
    return rc;
}

static PyObject *
in_place(PyObject *module, PyObject *unused)
{
    return PyBool_FromLong(mt_func != NULL);
}

static PyMethodDef methods[] = {
    {"choices", (PyCFunction)(void (*)(void))choices, METH_FASTCALL,
     "choices(rng, population, k): rng.choices(population, k=k) (contract: _draw.pyi)."},
    {"extended", (PyCFunction)(void (*)(void))extended, METH_FASTCALL,
     "extended(rng, population, head, total): head[:total] + choices(rng, population, "
     "total - len(head[:total])) as one new list (contract: _draw.pyi)."},
    {"packed", (PyCFunction)(void (*)(void))packed, METH_FASTCALL,
     "packed(rng, words, head, total): extended's prompt as an array('I'), words and head "
     "array('I')s too (contract: _draw.pyi)."},
    {"in_place", in_place, METH_NOARGS,
     "in_place(): whether the built-in generator's random() is computed from its state here."},
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
    if (s_random == NULL || init_in_place() < 0)
        return NULL;
    array_type = dyn_import_attr("array", "array");
    if (array_type == NULL)
        return NULL;
    return PyModule_Create(&module);
}

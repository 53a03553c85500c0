/*
 * dynamo.bench._stats: the report's order statistics of one latency series (count, mean, min,
 * p50, p90, p99, max of the values times a scale), the same floats as the Python definition.
 *
 * Why native: a replay's ITL series is one value per output token (620,000 for the 20k-request
 * benchmark); scaling them as Python floats and sorting the list took ~0.4 s, ~7 % of that run
 * (docs/performance.md, "Offline replay"). Here the values go into one array of doubles, are
 * scaled, sorted and summed there.
 *
 * Exactly the Python figures: the scaled value is the same IEEE product (``v * scale``, an int
 * converted first as Python converts it); the sort is a stable merge sort on ``<``, which for
 * values without NaN orders them exactly as Python's stable ``list.sort`` does (ties, -0.0 and
 * 0.0 included, keep their input order); the mean sums the sorted values left to right as the
 * built-in ``sum`` does (with its compensation from Python 3.12 on), divided by the count; the
 * percentiles interpolate with the same operations as ``bench.report.percentile``. A NaN (no
 * total order) or an item that is not an exact float or int returns None: the caller takes the
 * Python twin, ``_stats_fallback.py`` (tests/unit/bench/test_stats_native.py holds the two to
 * the same figures). The contract is ``_stats.pyi``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#define RUN 32 /* insertion-sorted runs, then merged */

static void
insertion_sort(double *a, Py_ssize_t n)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        double v = a[i];
        Py_ssize_t j = i;
        while (j > 0 && v < a[j - 1]) { /* strictly less: equal values keep their order */
            a[j] = a[j - 1];
            j--;
        }
        a[j] = v;
    }
}

/* Stable ascending sort of a[0..n) using tmp (n doubles). */
static void
merge_sort(double *a, double *tmp, Py_ssize_t n)
{
    for (Py_ssize_t lo = 0; lo < n; lo += RUN)
        insertion_sort(a + lo, (n - lo < RUN) ? n - lo : RUN);
    double *src = a, *dst = tmp;
    for (Py_ssize_t width = RUN; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n;
            Py_ssize_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi)
                dst[k++] = (src[j] < src[i]) ? src[j++] : src[i++]; /* left wins ties */
            while (i < mid)
                dst[k++] = src[i++];
            while (j < hi)
                dst[k++] = src[j++];
        }
        double *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != a)
        memcpy(a, src, (size_t)n * sizeof(double));
}

/* bench.report.percentile: pos = (n - 1) * q / 100.0, linear between its neighbours. */
static double
percentile(const double *a, Py_ssize_t n, long q)
{
    double pos = (double)((long long)(n - 1) * q) / 100.0;
    Py_ssize_t low = (Py_ssize_t)floor(pos);
    Py_ssize_t high = low + 1 < n - 1 ? low + 1 : n - 1;
    return a[low] + (a[high] - a[low]) * (pos - (double)low);
}

/* The built-in sum() of floats, left to right, from an int 0. */
static double
float_sum(const double *a, Py_ssize_t n)
{
    double total = 0.0;
#if PY_VERSION_HEX >= 0x030C0000
    double c = 0.0; /* Neumaier's compensation, as sum() has it from 3.12 on */
    for (Py_ssize_t i = 0; i < n; i++) {
        double x = a[i];
        double t = total + x;
        if (fabs(total) >= fabs(x))
            c += (total - t) + x;
        else
            c += (x - t) + total;
        total = t;
    }
    if (c != 0.0 && isfinite(c))
        total += c;
#else
    for (Py_ssize_t i = 0; i < n; i++)
        total += a[i];
#endif
    return total;
}

static PyObject *
figures(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "figures(values: list, scale: float)");
        return NULL;
    }
    double scale = PyFloat_AsDouble(args[1]);
    if (scale == -1.0 && PyErr_Occurred())
        return NULL;
    if (!PyFloat_CheckExact(args[1]))
        Py_RETURN_NONE; /* an int scale keeps int products: the Python twin's case */
    PyObject *list = args[0];
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n == 0)
        return Py_BuildValue("(nOOOOOO)", (Py_ssize_t)0, Py_None, Py_None, Py_None, Py_None,
                             Py_None, Py_None);
    double *a = PyMem_Malloc((size_t)n * 2 * sizeof(double));
    if (a == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        double v;
        if (PyFloat_CheckExact(item)) {
            v = PyFloat_AS_DOUBLE(item);
        }
        else if (PyLong_CheckExact(item)) {
            v = PyLong_AsDouble(item);
            if (v == -1.0 && PyErr_Occurred()) {
                PyMem_Free(a);
                return NULL; /* too large for a float: OverflowError, as v * scale raises */
            }
        }
        else {
            PyMem_Free(a);
            Py_RETURN_NONE;
        }
        v *= scale;
        if (isnan(v)) {
            PyMem_Free(a);
            Py_RETURN_NONE;
        }
        a[i] = v;
    }
    merge_sort(a, a + n, n);
    double mean = float_sum(a, n) / (double)n;
    PyObject *out = Py_BuildValue("(ndddddd)", n, mean, a[0], percentile(a, n, 50),
                                  percentile(a, n, 90), percentile(a, n, 99), a[n - 1]);
    PyMem_Free(a);
    return out;
}

static PyMethodDef module_methods[] = {
    {"figures", (PyCFunction)(void (*)(void))figures, METH_FASTCALL,
     "figures(values, scale) -> (count, mean, min, p50, p90, p99, max) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef stats_module = {
    PyModuleDef_HEAD_INIT, "_stats",
    "The report's order statistics of a series (contract: _stats.pyi; fallback: "
    "_stats_fallback.py).",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__stats(void)
{
    return PyModule_Create(&stats_module);
}

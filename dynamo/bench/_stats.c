/*
 * dynamo.bench._stats: the report's order statistics of one latency series (count, mean, min,
 * p50, p90, p99, max of the values times a scale), the same floats as the Python definition.
 *
 * Why native: a replay's ITL series is one value per output token (620,000 for the 20k-request
 * benchmark); scaling them as Python floats and sorting the list took ~0.4 s, ~7 % of that run
 * (docs/performance.md, "Offline replay"). Here the values go into one array of doubles, are
 * scaled, sorted and summed there; ``figures_joined`` reads them from the requests' own lists
 * (no joined list of 620,000 items first).
 *
 * Exactly the Python figures: the scaled value is the same IEEE product (``v * scale``, an int
 * converted first as Python converts it); the sort is a stable merge sort on ``<``, which for
 * values without NaN orders them exactly as Python's stable ``list.sort`` does (ties, -0.0 and
 * 0.0 included, keep their input order), or for a long series without -0.0 a radix sort of the
 * values' bits (the same order: equal keys are then equal doubles); the mean sums the sorted values left to right as the
 * built-in ``sum`` does (with its compensation from Python 3.12 on), divided by the count; the
 * percentiles interpolate with the same operations as ``bench.report.percentile``. A NaN (no
 * total order) or an item that is not an exact float or int returns None: the caller takes the
 * Python twin, ``_stats_fallback.py`` (tests/unit/bench/test_stats_native.py holds the two to
 * the same figures). The contract is ``_stats.pyi``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
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

/* LSD radix sort of n doubles with no NaN and no -0.0 (the caller checks): keys are the
 * doubles' bits mapped to unsigned order, so equal keys are equal doubles (their order among
 * themselves cannot show) and the result is exactly the stable comparison sort's. 11-bit
 * digits, a pass skipped where every key has the same digit (the exponents of a latency series
 * mostly agree). The result lands in a; tmp holds n doubles. */
#define DIGIT 11
#define BUCKETS (1 << DIGIT)
#define PASSES 6

static inline uint64_t
key_of(double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return (u >> 63) ? ~u : u ^ 0x8000000000000000ULL;
}

static int
radix_sort(double *a, double *tmp, Py_ssize_t n)
{
    Py_ssize_t(*count)[BUCKETS] = PyMem_Calloc(PASSES, sizeof *count);
    if (count == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = key_of(a[i]);
        for (int p = 0; p < PASSES; p++)
            count[p][(k >> (p * DIGIT)) & (BUCKETS - 1)]++;
    }
    double *src = a, *dst = tmp;
    for (int p = 0; p < PASSES; p++) {
        Py_ssize_t *c = count[p], sum = 0;
        if (c[(key_of(a[0]) >> (p * DIGIT)) & (BUCKETS - 1)] == n)
            continue; /* one digit for every key: this pass moves nothing */
        for (int b = 0; b < BUCKETS; b++) { /* counts -> starting places */
            Py_ssize_t here = c[b];
            c[b] = sum;
            sum += here;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            double v = src[i];
            dst[c[(key_of(v) >> (p * DIGIT)) & (BUCKETS - 1)]++] = v;
        }
        double *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != a)
        memcpy(a, src, (size_t)n * sizeof(double));
    PyMem_Free(count);
    return 0;
}

/* The values of ``list`` times ``scale`` into a[*at...]: 1 read, 0 the twin's case (an item
 * that is not an exact float or int, a NaN), -1 with an exception. *negzero set if a -0.0 was
 * read. */
static int
read_values(PyObject *list, double scale, double *a, Py_ssize_t *at, int *negzero)
{
    Py_ssize_t n = PyList_GET_SIZE(list), j = *at;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        double v;
        if (PyFloat_CheckExact(item)) {
            v = PyFloat_AS_DOUBLE(item);
        }
        else if (PyLong_CheckExact(item)) {
            v = PyLong_AsDouble(item);
            if (v == -1.0 && PyErr_Occurred())
                return -1; /* too large for a float: OverflowError, as v * scale raises */
        }
        else
            return 0;
        v *= scale;
        if (isnan(v))
            return 0;
        if (v == 0.0 && signbit(v))
            *negzero = 1;
        a[j++] = v;
    }
    *at = j;
    return 1;
}

/* The figures of a[0..n) (n > 0; tmp: n more doubles): sorted, summed, interpolated. */
static PyObject *
figures_of(double *a, Py_ssize_t n, int negzero)
{
    if (negzero || n < 256)
        merge_sort(a, a + n, n); /* -0.0 and 0.0 tie: their input order must be kept */
    else if (radix_sort(a, a + n, n) < 0)
        return PyErr_NoMemory();
    double mean = float_sum(a, n) / (double)n;
    return Py_BuildValue("(ndddddd)", n, mean, a[0], percentile(a, n, 50), percentile(a, n, 90),
                         percentile(a, n, 99), a[n - 1]);
}

static PyObject *
no_values(void)
{
    return Py_BuildValue("(nOOOOOO)", (Py_ssize_t)0, Py_None, Py_None, Py_None, Py_None, Py_None,
                         Py_None);
}

/* figures(values, scale), or figures_joined(lists, scale) of the lists' items in order. */
static PyObject *
compute(PyObject *const *args, Py_ssize_t nargs, int joined)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, joined ? "figures_joined(lists: list, scale: float)"
                                                : "figures(values: list, scale: float)");
        return NULL;
    }
    double scale = PyFloat_AsDouble(args[1]);
    if (scale == -1.0 && PyErr_Occurred())
        return NULL;
    if (!PyFloat_CheckExact(args[1]))
        Py_RETURN_NONE; /* an int scale keeps int products: the Python twin's case */
    PyObject *outer = args[0];
    Py_ssize_t parts = joined ? PyList_GET_SIZE(outer) : 1, n = 0;
    for (Py_ssize_t p = 0; p < parts; p++) {
        PyObject *list = joined ? PyList_GET_ITEM(outer, p) : outer;
        if (joined && !PyList_CheckExact(list))
            Py_RETURN_NONE; /* not a list: the twin joins whatever iterables these are */
        n += PyList_GET_SIZE(list);
    }
    if (n == 0)
        return no_values();
    double *a = PyMem_Malloc((size_t)n * 2 * sizeof(double));
    if (a == NULL)
        return PyErr_NoMemory();
    Py_ssize_t at = 0;
    int negzero = 0, rc = 1;
    for (Py_ssize_t p = 0; p < parts && rc == 1; p++) /* the lists cannot change meanwhile */
        rc = read_values(joined ? PyList_GET_ITEM(outer, p) : outer, scale, a, &at, &negzero);
    PyObject *out = rc < 0 ? NULL : rc == 0 ? Py_NewRef(Py_None) : figures_of(a, n, negzero);
    PyMem_Free(a);
    return out;
}

static PyObject *
figures(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return compute(args, nargs, 0);
}

static PyObject *
figures_joined(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return compute(args, nargs, 1);
}

static PyMethodDef module_methods[] = {
    {"figures", (PyCFunction)(void (*)(void))figures, METH_FASTCALL,
     "figures(values, scale) -> (count, mean, min, p50, p90, p99, max) or None"},
    {"figures_joined", (PyCFunction)(void (*)(void))figures_joined, METH_FASTCALL,
     "figures_joined(lists, scale) -> figures of the lists' items in order, or None"},
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

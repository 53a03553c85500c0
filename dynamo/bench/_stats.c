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
#include "../_slots.h"

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

/* The built-in sum() of floats, left to right, from an int 0: ``sum_add`` each value in order,
 * then ``sum_result``. */
typedef struct {
    double total, c; /* c: Neumaier's compensation, as sum() has it from 3.12 on */
} Sum;

static inline void
sum_add(Sum *s, double x)
{
#if PY_VERSION_HEX >= 0x030C0000
    double t = s->total + x;
    if (fabs(s->total) >= fabs(x))
        s->c += (s->total - t) + x;
    else
        s->c += (x - t) + s->total;
    s->total = t;
#else
    s->total += x;
#endif
}

static inline double
sum_result(const Sum *s)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (s->c != 0.0 && isfinite(s->c))
        return s->total + s->c;
#endif
    return s->total;
}

static double
float_sum(const double *a, Py_ssize_t n)
{
    Sum s = {0.0, 0.0};
    for (Py_ssize_t i = 0; i < n; i++)
        sum_add(&s, a[i]);
    return sum_result(&s);
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

/* One item of a series times ``scale`` into *v: 1 read, 0 the twin's case (an item that is not
 * an exact float or int, a NaN), -1 with an exception. */
static inline int
item_value(PyObject *item, double scale, double *v)
{
    double x;
    if (PyFloat_CheckExact(item)) {
        x = PyFloat_AS_DOUBLE(item);
    }
    else if (PyLong_CheckExact(item)) {
        x = PyLong_AsDouble(item);
        if (x == -1.0 && PyErr_Occurred())
            return -1; /* too large for a float: OverflowError, as v * scale raises */
    }
    else
        return 0;
    x *= scale;
    if (isnan(x))
        return 0;
    *v = x;
    return 1;
}

static inline int
is_negzero(double v)
{
    return v == 0.0 && signbit(v);
}

/* The values of ``list`` times ``scale`` into a[*at...]: as ``item_value``. *negzero set if
 * a -0.0 was read. */
static int
read_values(PyObject *list, double scale, double *a, Py_ssize_t *at, int *negzero)
{
    Py_ssize_t n = PyList_GET_SIZE(list), j = *at;
    for (Py_ssize_t i = 0; i < n; i++) {
        double v;
        int rc = item_value(PyList_GET_ITEM(list, i), scale, &v);
        if (rc <= 0)
            return rc;
        *negzero |= is_negzero(v);
        a[j++] = v;
    }
    *at = j;
    return 1;
}

/* bench.report.percentile's places for the q-th percentile of n sorted values: the value at
 * ``low``, the one at ``high`` and the fraction between them. */
typedef struct {
    Py_ssize_t low, high;
    double frac;
} Place;

static Place
place_of(Py_ssize_t n, long q)
{
    double pos = (double)((long long)(n - 1) * q) / 100.0;
    Py_ssize_t low = (Py_ssize_t)floor(pos);
    Place p = {low, low + 1 < n - 1 ? low + 1 : n - 1, pos - (double)low};
    return p;
}

static double
interpolate(double low, double high, double frac)
{
    return low + (high - low) * frac;
}

static double
percentile(const double *a, Py_ssize_t n, long q)
{
    Place p = place_of(n, q);
    return interpolate(a[p.low], a[p.high], p.frac);
}

/* Whether a[0..n) are all the same double, bit for bit (already sorted: a synthetic
 * workload's token counts). */
static int
constant(const double *a, Py_ssize_t n)
{
    for (Py_ssize_t i = 1; i < n; i++)
        if (memcmp(&a[i], &a[0], sizeof(double)) != 0)
            return 0;
    return 1;
}

/* The figures of a[0..n) (n > 0; tmp: n more doubles): sorted, summed, interpolated. */
static PyObject *
figures_of(double *a, Py_ssize_t n, int negzero)
{
    if (constant(a, n))
        ; /* sorted as they are */
    else if (negzero || n < 256)
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

/* -- a long series with many ties, by its distinct values ---------------------------------
 *
 * A replay's ITLs are one value per output token (620,000 in the 20k benchmark) but only
 * ~10,000 distinct values (a pass's tokens share one gap): counting each distinct value in a
 * hash table and sorting those is ~3x cheaper than moving every value through a radix sort,
 * and gives the same figures: the sorted series is each distinct value, ascending, repeated
 * its count of times (equal doubles cannot show their order, -0.0 aside: a series holding one
 * takes the array path, whose merge sort keeps it in its input order). The sum runs over that
 * same sequence, value by value. A series with too many distinct values (more than one in
 * TALLY_SHARE) gives up early and takes the array path. */
#define TALLY_MIN 4096 /* shorter series: the array path */
#define TALLY_SHARE 8
#define SEEN_BITS 12 /* the items met last, by address: a few pages */
#define FIB 0x9E3779B97F4A7C15ULL /* Fibonacci hashing's multiplier: 2^64 / the golden ratio */

typedef struct {
    uint64_t bits; /* the double's bits */
    Py_ssize_t count; /* 0: an empty slot */
} Slot;

/* An item met lately and the slot of its value: the ITLs' floats are shared (one object per
 * gap of a pass, in each of its requests' lists), so most items are met again soon (~86 % of
 * the 20k benchmark's), and are counted without reading the float or probing the table
 * (memory-bound: those reads missed the caches; 12.9 -> 9.6 ms for its 620,000 ITLs). */
typedef struct {
    PyObject *item;
    Py_ssize_t slot;
} Seen;

typedef struct {
    Slot *slots;
    Py_ssize_t mask, used, limit;
    int shift; /* 64 - log2(slots) */
    Seen *seen; /* 1 << SEEN_BITS; cleared when the slots move */
} Tally;

static inline Py_ssize_t
slot_of(const Tally *t, uint64_t bits)
{
    Py_ssize_t i = (Py_ssize_t)((bits * FIB) >> t->shift);
    while (t->slots[i].count != 0 && t->slots[i].bits != bits)
        i = (i + 1) & t->mask;
    return i;
}

/* Twice the slots, the counts rehashed: 0, or -1 out of memory. */
static int
tally_grow(Tally *t)
{
    Tally bigger = *t;
    bigger.slots = PyMem_Calloc((size_t)(t->mask + 1) * 2, sizeof(Slot));
    if (bigger.slots == NULL)
        return -1;
    bigger.mask = t->mask * 2 + 1;
    bigger.shift = t->shift - 1;
    for (Py_ssize_t i = 0; i <= t->mask; i++)
        if (t->slots[i].count != 0)
            bigger.slots[slot_of(&bigger, t->slots[i].bits)] = t->slots[i];
    PyMem_Free(t->slots);
    memset(bigger.seen, 0, sizeof(Seen) << SEEN_BITS); /* their slots moved */
    *t = bigger;
    return 0;
}

/* Count one more ``v``: its slot, -1 when that makes more distinct values than the limit, -2
 * out of memory. */
static inline Py_ssize_t
tally_add(Tally *t, double v)
{
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    Py_ssize_t at = slot_of(t, bits);
    Slot *slot = &t->slots[at];
    if (slot->count++ != 0)
        return at;
    slot->bits = bits;
    if (++t->used > t->limit)
        return -1;
    if (t->used * 2 > t->mask) {
        if (tally_grow(t) < 0)
            return -2;
        at = slot_of(t, bits);
    }
    return at;
}

/* The figures of the n values counted in ``t``. */
static PyObject *
tally_figures_of(const Tally *t, Py_ssize_t n)
{
    Py_ssize_t d = t->used;
    double *values = PyMem_Malloc((size_t)d * 2 * sizeof(double));
    Py_ssize_t *upto = PyMem_Malloc((size_t)d * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (values == NULL || upto == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i <= t->mask; i++)
        if (t->slots[i].count != 0)
            memcpy(&values[k++], &t->slots[i].bits, sizeof(double));
    merge_sort(values, values + d, d); /* distinct values: any correct sort */
    Sum sum = {0.0, 0.0};
    Py_ssize_t seen = 0;
    for (k = 0; k < d; k++) {
        uint64_t bits;
        memcpy(&bits, &values[k], sizeof bits);
        Py_ssize_t count = t->slots[slot_of(t, bits)].count;
        for (Py_ssize_t c = 0; c < count; c++) /* the sorted series' sum, item by item */
            sum_add(&sum, values[k]);
        upto[k] = seen += count; /* items up to and including this value */
    }
    double at[3];
    static const long qs[3] = {50, 90, 99};
    for (int q = 0; q < 3; q++) {
        Place p = place_of(n, qs[q]);
        Py_ssize_t lo = 0; /* the first value whose items reach past p.low */
        while (upto[lo] <= p.low)
            lo++;
        Py_ssize_t hi = lo; /* and past p.high (p.high is p.low or the next item) */
        while (upto[hi] <= p.high)
            hi++;
        at[q] = interpolate(values[lo], values[hi], p.frac);
    }
    out = Py_BuildValue("(ndddddd)", n, sum_result(&sum) / (double)n, values[0], at[0], at[1],
                        at[2], values[d - 1]);
done:
    PyMem_Free(values);
    PyMem_Free(upto);
    return out;
}

/* The figures of the lists' items times ``scale`` by their distinct values: 1 with *out set
 * (the figures, None for the twin's case, NULL with an exception), 0 when the series does not
 * suit (too many distinct values, a -0.0): the caller takes the array path. */
static int
tally_figures(PyObject *const *lists, Py_ssize_t parts, Py_ssize_t n, double scale,
              PyObject **out)
{
    Tally t = {PyMem_Calloc(1024, sizeof(Slot)), 1023, 0, n / TALLY_SHARE, 64 - 10,
               PyMem_Calloc((size_t)1 << SEEN_BITS, sizeof(Seen))};
    int suits = 1;
    *out = NULL;
    if (t.slots == NULL || t.seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t p = 0; p < parts; p++) { /* the lists cannot change meanwhile */
        PyObject *const *items = ((PyListObject *)lists[p])->ob_item;
        Py_ssize_t size = PyList_GET_SIZE(lists[p]);
        for (Py_ssize_t i = 0; i < size; i++) {
            PyObject *item = items[i];
            Seen *seen = &t.seen[((uintptr_t)item * FIB) >> (64 - SEEN_BITS)];
            if (seen->item == item) { /* the same object: the same value */
                t.slots[seen->slot].count++;
                continue;
            }
            double v;
            int rc = item_value(item, scale, &v);
            if (rc <= 0) { /* the twin's case (None) or an exception (NULL) */
                *out = rc < 0 ? NULL : Py_NewRef(Py_None);
                goto done;
            }
            Py_ssize_t at = is_negzero(v) ? -1 : tally_add(&t, v);
            if (at == -1) {
                suits = 0;
                goto done;
            }
            if (at == -2) {
                PyErr_NoMemory();
                goto done;
            }
            *seen = (Seen){item, at};
        }
    }
    *out = tally_figures_of(&t, n);
done:
    PyMem_Free(t.slots);
    PyMem_Free(t.seen);
    return suits;
}

/* The figures of the items of lists[0..parts) (exact lists) times ``scale``, n in all. */
static PyObject *
series_figures(PyObject *const *lists, Py_ssize_t parts, Py_ssize_t n, double scale)
{
    if (n == 0)
        return no_values();
    PyObject *out;
    if (n >= TALLY_MIN && tally_figures(lists, parts, n, scale, &out))
        return out;
    double *a = PyMem_Malloc((size_t)n * 2 * sizeof(double));
    if (a == NULL)
        return PyErr_NoMemory();
    Py_ssize_t at = 0;
    int negzero = 0, rc = 1;
    for (Py_ssize_t p = 0; p < parts && rc == 1; p++) /* the lists cannot change meanwhile */
        rc = read_values(lists[p], scale, a, &at, &negzero);
    out = rc < 0 ? NULL : rc == 0 ? Py_NewRef(Py_None) : figures_of(a, n, negzero);
    PyMem_Free(a);
    return out;
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
    PyObject *const *lists = joined ? ((PyListObject *)outer)->ob_item : &outer;
    Py_ssize_t parts = joined ? PyList_GET_SIZE(outer) : 1, n = 0;
    for (Py_ssize_t p = 0; p < parts; p++) {
        if (!PyList_CheckExact(lists[p]))
            Py_RETURN_NONE; /* not a list: the twin joins whatever iterables these are */
        n += PyList_GET_SIZE(lists[p]);
    }
    return series_figures(lists, parts, n, scale);
}

/* -- a run's records, read in one pass ------------------------------------------------------
 *
 * ``record_figures(records)``: what ``bench.report.summarize`` reads of each request, its
 * series' figures included (the twin: ``_stats_fallback.record_figures``, the definition, as
 * ``RequestRecord``'s ``e2e`` and ``tpot`` properties compute them). Why native: a replay
 * summarizes tens of thousands of records; reading ~15 attributes and properties of each in
 * Python was ~30 ms of the 20k benchmark's ~1 s, the same reads here at the fields' slot
 * offsets (``dynamo/_slots.h``) a fraction of that, and the series go into arrays of doubles
 * without a Python float or list each. Only exact ``RequestRecord`` s whose fields hold what a
 * run writes (exact floats, ints within 64 bits, lists, None) are read here; anything else
 * returns None, and the caller takes the twin (the same figures, by their definition). */
static const char *const record_fields[] = {
    "start", "end", "ttft", "itl", "output_tokens", "prompt_tokens", "cached_tokens",
    "expected_prompt_tokens", "error",
};
enum { R_START, R_END, R_TTFT, R_ITL, R_OUTPUT, R_PROMPT, R_CACHED, R_EXPECTED, R_ERROR };
static DynSlots record_slots = DYN_SLOTS_OF(record_fields);
static PyTypeObject *record_type; /* dynamo.bench.request.RequestRecord, at the first call */

/* A series being gathered: its values (room for as many again: the sort's) and whether one is
 * a -0.0. */
typedef struct {
    double *a;
    Py_ssize_t n;
    int negzero;
} Column;

/* Append ``v`` (already scaled): 0, or -1 for a NaN (the twin's case). */
static inline int
column_push(Column *c, double v)
{
    if (isnan(v))
        return -1;
    c->negzero |= is_negzero(v);
    c->a[c->n++] = v;
    return 0;
}

static PyObject *
column_figures(Column *c)
{
    return c->n == 0 ? no_values() : figures_of(c->a, c->n, c->negzero);
}

/* An exact int within 64 bits into *v: 1, 0 the twin's case (another type, a larger int). */
static inline int
int_value(PyObject *o, long long *v)
{
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow;
    *v = PyLong_AsLongLongAndOverflow(o, &overflow);
    return !overflow;
}

/* The RequestRecord class, its slot offsets learned: 1, 0 if they cannot be (the twin's
 * case: a class whose fields are not plain slots), -1 with an exception. */
static int
learn_record_type(void)
{
    if (record_type == NULL) {
        PyObject *module = PyImport_ImportModule("dynamo.bench.request");
        if (module == NULL)
            return -1;
        PyObject *type = PyObject_GetAttrString(module, "RequestRecord");
        Py_DECREF(module);
        if (type == NULL)
            return -1;
        if (!PyType_Check(type)) {
            Py_DECREF(type);
            PyErr_SetString(PyExc_TypeError, "dynamo.bench.request.RequestRecord: not a class");
            return -1;
        }
        record_type = (PyTypeObject *)type;
        dyn_slots_learn(&record_slots, record_type);
    }
    return record_slots.type == record_type;
}

typedef struct {
    Py_ssize_t ok, parts, itl_n;
    long long output_total, prompt_total, cached_total, mismatch;
    Column ttft, tpot, e2e, inputs, outputs;
    PyObject **itl; /* the completed records' ITL lists (borrowed: the records hold them) */
    PyObject *failed; /* the failed records, in order */
} Gathered;

/* One record into ``g``: 1, 0 the twin's case, -1 with an exception. */
static int
gather(Gathered *g, PyObject *r)
{
    if (Py_TYPE(r) != record_type)
        return 0;
    PyObject *f[R_ERROR + 1];
    for (int k = 0; k <= R_ERROR; k++)
        if ((f[k] = *(PyObject **)((char *)r + record_slots.offsets[k])) == NULL)
            return 0; /* an unset field: the twin raises the AttributeError */
    if (f[R_ERROR] != Py_None)
        return PyList_Append(g->failed, r) < 0 ? -1 : 1;
    long long out, prompt = 0, cached = 0, expected;
    if (!int_value(f[R_OUTPUT], &out) || !PyList_CheckExact(f[R_ITL]) ||
        !PyFloat_CheckExact(f[R_START]) || !PyFloat_CheckExact(f[R_END]) ||
        !(f[R_TTFT] == Py_None || PyFloat_CheckExact(f[R_TTFT])) ||
        !(f[R_PROMPT] == Py_None || int_value(f[R_PROMPT], &prompt)))
        return 0;
    g->ok++;
    if (__builtin_add_overflow(g->output_total, out, &g->output_total))
        return 0;
    if (column_push(&g->outputs, (double)out) < 0)
        return 0;
    g->itl[g->parts++] = f[R_ITL];
    g->itl_n += PyList_GET_SIZE(f[R_ITL]);
    double e2e = PyFloat_AS_DOUBLE(f[R_END]) - PyFloat_AS_DOUBLE(f[R_START]); /* .e2e */
    if (column_push(&g->e2e, e2e * 1000.0) < 0)
        return 0;
    if (f[R_TTFT] != Py_None) {
        double ttft = PyFloat_AS_DOUBLE(f[R_TTFT]);
        if (column_push(&g->ttft, ttft * 1000.0) < 0)
            return 0;
        if (out >= 2 && column_push(&g->tpot, (e2e - ttft) / (double)(out - 1) * 1000.0) < 0)
            return 0; /* .tpot: (e2e - ttft) / (output_tokens - 1), the int made a float */
    }
    if (f[R_PROMPT] != Py_None) {
        if (!(f[R_CACHED] == Py_None || int_value(f[R_CACHED], &cached)) ||
            !int_value(f[R_EXPECTED], &expected))
            return 0;
        if (column_push(&g->inputs, (double)prompt) < 0 ||
            __builtin_add_overflow(g->prompt_total, prompt, &g->prompt_total) ||
            __builtin_add_overflow(g->cached_total, cached, &g->cached_total))
            return 0;
        g->mismatch += prompt != expected;
    }
    return 1;
}

static PyObject *
record_figures(PyObject *module, PyObject *records)
{
    if (!PyList_Check(records)) {
        PyErr_SetString(PyExc_TypeError, "record_figures(records: list)");
        return NULL;
    }
    int known = learn_record_type();
    if (known <= 0)
        return known < 0 ? NULL : Py_NewRef(Py_None);
    Py_ssize_t n = PyList_GET_SIZE(records);
    Gathered g = {0};
    double *room = PyMem_Malloc(((size_t)n * 10 + 1) * sizeof(double)); /* 5 columns, 2n each */
    g.itl = PyMem_Malloc(((size_t)n + 1) * sizeof(PyObject *));
    g.failed = PyList_New(0);
    PyObject *out = NULL;
    if (room == NULL || g.itl == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (g.failed == NULL)
        goto done;
    Column *columns[] = {&g.ttft, &g.tpot, &g.e2e, &g.inputs, &g.outputs};
    for (int c = 0; c < 5; c++)
        columns[c]->a = room + (size_t)c * 2 * (size_t)n;
    for (Py_ssize_t i = 0; i < n; i++) { /* no Python code runs: the list cannot change */
        int rc = gather(&g, PyList_GET_ITEM(records, i));
        if (rc <= 0) {
            out = rc < 0 ? NULL : Py_NewRef(Py_None);
            goto done;
        }
    }
    /* the summary's order: ttft, itl, tpot, e2e, input and output tokens; the ITLs first,
     * while the borrowed lists are certainly alive (a figures tuple's allocation may run a
     * collection, whose finalizers could change a record), the columns are our arrays */
    static const int order[6] = {1, 0, 2, 3, 4, 5};
    PyObject *figures[6] = {NULL};
    int k;
    for (k = 0; k < 6; k++) {
        int f = order[k];
        figures[f] = f == 1 ? series_figures(g.itl, g.parts, g.itl_n, 1000.0)
                            : column_figures(columns[f == 0 ? 0 : f - 1]);
        if (figures[f] == NULL || figures[f] == Py_None) /* an error; a NaN or odd gap */
            break;
    }
    if (k == 6)
        out = Py_BuildValue("(nOOOOOOOLLLL)", g.ok, g.failed, figures[0], figures[1], figures[2],
                            figures[3], figures[4], figures[5], g.output_total, g.prompt_total,
                            g.cached_total, g.mismatch);
    else if (figures[order[k]] != NULL)
        out = Py_NewRef(Py_None);
    for (k = 0; k < 6; k++)
        Py_XDECREF(figures[k]);
done:
    PyMem_Free(room);
    PyMem_Free(g.itl);
    Py_XDECREF(g.failed);
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
    {"record_figures", record_figures, METH_O,
     "record_figures(records) -> the summary's counts and figures of RequestRecords, or None"},
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
    if (dyn_slots_init(&record_slots) < 0)
        return NULL;
    return PyModule_Create(&stats_module);
}

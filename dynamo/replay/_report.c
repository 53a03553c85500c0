/*
 * dynamo.replay._report: what the replay's report reads of its flights, in one pass.
 *
 * ``flight_figures(flights)``: the flights' records in order, the last end among them (the
 * measured window; 0.0 for none) and, per ``(worker_id, dp_rank)`` of the routed requests
 * that completed, ``[requests, prompt tokens, cached tokens]`` (``or 0`` each), the workers in
 * the order their first such request comes.
 *
 * Why native: ``run_replay`` reads these of every request after the simulation (20,000 in the
 * 20k-request benchmark); in Python the pass was ~2.9k instructions a request, ~5 ms of the
 * run, most of what was left of its report once the records' figures moved to
 * ``bench/_stats.c``. Here the fields are read at their slot offsets (``dynamo/_slots.h``).
 *
 * Only exact ``Flight`` s whose record is an exact ``RequestRecord`` and whose routing is None
 * or an exact ``RoutingRecord``, holding what a run writes (an exact float end, exact ints
 * within 64 bits or None), are read here; anything else returns None and the caller takes
 * the twin, ``_report_fallback.py``: the definition (the contract: ``_report.pyi``;
 * tests/unit/replay/test_report_native.py holds the two to the same answers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include "../_slots.h"

static const char *const flight_fields[] = {"record", "routing"};
static const char *const record_fields[] = {"end", "error", "prompt_tokens", "cached_tokens"};
static const char *const routing_fields[] = {"worker_id", "dp_rank"};
enum { F_RECORD, F_ROUTING };
enum { R_END, R_ERROR, R_PROMPT, R_CACHED };
enum { W_WORKER, W_RANK };
static DynSlots flight_slots = DYN_SLOTS_OF(flight_fields),
                record_slots = DYN_SLOTS_OF(record_fields),
                routing_slots = DYN_SLOTS_OF(routing_fields);

/* The classes, imported at the first call (their modules import this one's caller). */
static struct {
    const char *module, *name;
    DynSlots *slots;
    PyTypeObject *type;
} classes[] = {
    {"dynamo.replay.flight", "Flight", &flight_slots, NULL},
    {"dynamo.bench.request", "RequestRecord", &record_slots, NULL},
    {"dynamo.replay.pools", "RoutingRecord", &routing_slots, NULL},
};
enum { C_FLIGHT, C_RECORD, C_ROUTING, C_COUNT };

/* The classes, their slot offsets learned: 1, 0 if they cannot be (a class whose fields are not
 * plain slots: the twin's case), -1 with an exception. */
static int
learn_classes(void)
{
    int known = 1;
    for (int c = 0; c < C_COUNT; c++) {
        if (classes[c].type == NULL) {
            PyObject *module = PyImport_ImportModule(classes[c].module);
            if (module == NULL)
                return -1;
            PyObject *type = PyObject_GetAttrString(module, classes[c].name);
            Py_DECREF(module);
            if (type == NULL)
                return -1;
            if (!PyType_Check(type)) {
                PyErr_Format(PyExc_TypeError, "%s.%s: not a class", classes[c].module,
                             classes[c].name);
                Py_DECREF(type);
                return -1;
            }
            classes[c].type = (PyTypeObject *)type;
            dyn_slots_learn(classes[c].slots, classes[c].type);
        }
        known &= classes[c].slots->type == classes[c].type;
    }
    return known;
}

/* ``obj``'s field ``k`` (borrowed; NULL when unset: the twin raises the AttributeError). */
static inline PyObject *
field(DynSlots *l, PyObject *obj, int k)
{
    return *(PyObject **)((char *)obj + l->offsets[k]);
}

/* An exact int within 64 bits into *v: 1, 0 the twin's case. */
static inline int
int_value(PyObject *o, long long *v)
{
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow;
    *v = PyLong_AsLongLongAndOverflow(o, &overflow);
    return !overflow;
}

/* ``o or 0`` of None or an exact int within 64 bits into *v: 1, 0 the twin's case. */
static inline int
count_value(PyObject *o, long long *v)
{
    if (o == Py_None) {
        *v = 0;
        return 1;
    }
    return int_value(o, v);
}

/* One worker's totals, the workers in first-met order; ``index`` finds them by key. */
typedef struct {
    long long worker, rank, requests, prompt, cached;
} Worker;

typedef struct {
    Worker *rows;
    Py_ssize_t n, room;
    Py_ssize_t *index; /* open addressing: row + 1, 0 empty; size ``mask + 1`` */
    Py_ssize_t mask;
} Workers;

static inline Py_ssize_t
place_of(const Workers *w, long long worker, long long rank)
{
    uint64_t h = ((uint64_t)worker * 0x9E3779B97F4A7C15ULL) ^ (uint64_t)rank;
    Py_ssize_t i = (Py_ssize_t)((h * 0x9E3779B97F4A7C15ULL) >> 40) & w->mask;
    for (;;) {
        Py_ssize_t at = w->index[i];
        if (at == 0 || (w->rows[at - 1].worker == worker && w->rows[at - 1].rank == rank))
            return i;
        i = (i + 1) & w->mask;
    }
}

/* The row of ``(worker, rank)``, added if new: NULL out of memory. */
static Worker *
row_of(Workers *w, long long worker, long long rank)
{
    Py_ssize_t i = place_of(w, worker, rank);
    if (w->index[i] != 0)
        return &w->rows[w->index[i] - 1];
    if (w->n == w->room) { /* more rows, and an index twice their room */
        Py_ssize_t room = w->room * 2;
        Worker *rows = PyMem_Realloc(w->rows, (size_t)room * sizeof(Worker));
        if (rows == NULL)
            return NULL;
        w->rows = rows;
        Py_ssize_t *index = PyMem_Calloc((size_t)room * 2, sizeof(Py_ssize_t));
        if (index == NULL)
            return NULL;
        PyMem_Free(w->index);
        w->index = index;
        w->room = room;
        w->mask = room * 2 - 1;
        for (Py_ssize_t r = 0; r < w->n; r++)
            w->index[place_of(w, w->rows[r].worker, w->rows[r].rank)] = r + 1;
        i = place_of(w, worker, rank);
    }
    w->rows[w->n] = (Worker){worker, rank, 0, 0, 0};
    w->index[i] = ++w->n;
    return &w->rows[w->n - 1];
}

/* One flight's routing into ``w`` (its record completed): 1, 0 the twin's case, -1 out of
 * memory. */
static int
add_routed(Workers *w, PyObject *routing, PyObject *record)
{
    PyObject *worker_id, *dp_rank, *prompt_tokens, *cached_tokens;
    long long worker, rank, prompt, cached;
    if (Py_TYPE(routing) != classes[C_ROUTING].type ||
        (worker_id = field(&routing_slots, routing, W_WORKER)) == NULL ||
        (dp_rank = field(&routing_slots, routing, W_RANK)) == NULL ||
        (prompt_tokens = field(&record_slots, record, R_PROMPT)) == NULL ||
        (cached_tokens = field(&record_slots, record, R_CACHED)) == NULL ||
        !int_value(worker_id, &worker) || !int_value(dp_rank, &rank) ||
        !count_value(prompt_tokens, &prompt) || !count_value(cached_tokens, &cached))
        return 0;
    Worker *row = row_of(w, worker, rank);
    if (row == NULL)
        return -1;
    row->requests++;
    if (__builtin_add_overflow(row->prompt, prompt, &row->prompt) ||
        __builtin_add_overflow(row->cached, cached, &row->cached))
        return 0;
    return 1;
}

/* The totals as the twin's dict: ``{(worker_id, dp_rank): [requests, prompt, cached]}``. */
static PyObject *
totals_dict(const Workers *w)
{
    PyObject *out = PyDict_New();
    for (Py_ssize_t r = 0; out != NULL && r < w->n; r++) {
        const Worker *row = &w->rows[r];
        PyObject *key = Py_BuildValue("(LL)", row->worker, row->rank);
        PyObject *value = Py_BuildValue("[LLL]", row->requests, row->prompt, row->cached);
        if (key == NULL || value == NULL || PyDict_SetItem(out, key, value) < 0)
            Py_CLEAR(out);
        Py_XDECREF(key);
        Py_XDECREF(value);
    }
    return out;
}

static PyObject *
flight_figures(PyObject *module, PyObject *flights)
{
    if (!PyList_Check(flights)) {
        PyErr_SetString(PyExc_TypeError, "flight_figures(flights: list)");
        return NULL;
    }
    int known = learn_classes();
    if (known <= 0)
        return known < 0 ? NULL : Py_NewRef(Py_None);
    Py_ssize_t n = PyList_GET_SIZE(flights);
    PyObject *records = PyList_New(n), *window = NULL, *out = NULL;
    Workers w = {PyMem_Malloc(8 * sizeof(Worker)), 0, 8, PyMem_Calloc(16, sizeof(Py_ssize_t)), 15};
    if (records == NULL)
        goto done;
    if (w.rows == NULL || w.index == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double last = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) { /* no Python code runs: the list cannot change */
        PyObject *flight = PyList_GET_ITEM(flights, i), *record, *routing, *end, *error;
        if (Py_TYPE(flight) != classes[C_FLIGHT].type ||
            (record = field(&flight_slots, flight, F_RECORD)) == NULL ||
            (routing = field(&flight_slots, flight, F_ROUTING)) == NULL ||
            Py_TYPE(record) != classes[C_RECORD].type ||
            (end = field(&record_slots, record, R_END)) == NULL || !PyFloat_CheckExact(end) ||
            (error = field(&record_slots, record, R_ERROR)) == NULL)
            goto defer;
        PyList_SET_ITEM(records, i, Py_NewRef(record));
        double at = PyFloat_AS_DOUBLE(end);
        if (window == NULL || at > last) { /* max(): the first of the largest */
            window = end;
            last = at;
        }
        if (routing != Py_None && error == Py_None) {
            int rc = add_routed(&w, routing, record);
            if (rc <= 0) {
                if (rc < 0)
                    PyErr_NoMemory();
                else
                    goto defer;
                goto done;
            }
        }
    }
    /* a strong reference first: the dict's allocations may run a collection, whose finalizers
     * could set the record's end to another float */
    window = window != NULL ? Py_NewRef(window) : PyFloat_FromDouble(0.0);
    PyObject *totals = window != NULL ? totals_dict(&w) : NULL;
    if (totals != NULL)
        out = Py_BuildValue("(ONN)", records, window, totals);
    else
        Py_XDECREF(window);
    goto done;
defer:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(records); /* a record not set yet is NULL: list_dealloc skips it */
    PyMem_Free(w.rows);
    PyMem_Free(w.index);
    return out;
}

static PyMethodDef module_methods[] = {
    {"flight_figures", flight_figures, METH_O,
     "flight_figures(flights) -> (records, window, worker totals), or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef report_module = {
    PyModuleDef_HEAD_INIT, "_report",
    "What the replay's report reads of its flights, in one pass (contract: _report.pyi; "
    "fallback: _report_fallback.py).",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__report(void)
{
    for (int c = 0; c < C_COUNT; c++)
        if (dyn_slots_init(classes[c].slots) < 0)
            return NULL;
    return PyModule_Create(&report_module);
}

/*
 * dynamo.replay._loop: the replay's event loop in C, the fast path of ``Simulation._phase``.
 *
 * ``run(sim, queue, timeouts, counter, wake, deliver)`` runs one phase to its end and returns
 * the events it processed. It is ``Simulation._phase``'s loop with ``_pass_start`` and
 * ``_pass_end`` (simulator.py, the reference: ``DYN_NATIVE=0`` and a missing build run that
 * Python) step for step: the same calls on the collaborators in the same order, so the same
 * records, routing and counters. What is not a pass stays in Python and is called back: a send
 * (``wake(runner)``), a request deadline (``sim._time_out``), the finished requests of a pass
 * (``sim._retire``), the router queue's release (``sim._release_held``); the engine pass itself
 * is ``MockerScheduler.step`` without its ``StepOutput``: ``sched.mock_pass`` (the kernel's
 * tuple, kept in ``rank.raw`` until the pass end) timed here as ``TimingModel.pass_seconds``
 * times it (the same float operations; tests/unit/replay/test_loop_native.py compares them
 * bit for bit); the KV events go to ``core.apply_events``, the tokens to ``deliver``
 * (``dynamo.replay.deliver``).
 *
 * Why native: at 100 workers a request costs ~22 passes of one token each, and the Python glue
 * of a pass (the loop's dispatch, ``_pass_start``, ``_pass_end``) was a large share of the run
 * (docs/performance.md, "Offline replay"); here it is a few attribute loads and calls.
 *
 * ``sim.now`` is set before anything runs at a new instant, as the Python loop does; the
 * simulation's ``_events`` counter is the returned count (the caller stores it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../_import.h"
#include "../_slots.h"

/* The event kinds and rank states (simulator.py's ``_SEND`` ..., pools.py's ``IDLE`` ...);
 * the module exports them and a test holds them equal to the Python names. */
enum { K_SEND = 0, K_PASS_END = 1, K_PASS_START = 2 };
enum { R_IDLE = 0, R_SCHEDULED = 1, R_BUSY = 2 };

/* The slotted dataclasses' fields it reads and writes, at their offsets (dynamo/_slots.h):
 * pools.py's Rank and Pool, mocker/timing.py's TimingModel (read only: it is frozen). */
static const char *const rank_fields[] = {"sched", "pool", "state", "raw", "passes", "worker_id"};
static const char *const pool_fields[] = {"core", "role", "queue", "config"};
static const char *const timing_fields[] = {"speedup_ratio", "decode_speedup_ratio",
                                            "total_kv_tokens"};
/* A finished request's bookkeeping (``Simulation._retire`` and ``_finish``): flight.py's
 * Flight, bench/request.py's RequestRecord, engine_core/sequence.py's Sequence. */
static const char *const flight_fields[] = {"request_id", "record", "done",    "tokens", "spec",
                                            "load",       "runner", "routing", "rank"};
/* A request to send (bench/request.py's RequestSpec): what ``Simulation._send`` reads. */
static const char *const spec_fields[] = {"prompt", "max_tokens", "expected_prompt_tokens",
                                          "session", "turn", "group"};
static const char *const record_fields[] = {"end",           "status", "prompt_tokens",
                                            "cached_tokens", "finish_reason", "itl"};
static const char *const seq_fields[] = {"request_id", "num_prompt_tokens", "num_cached_tokens",
                                         "finish_reason"};
enum { RK_SCHED, RK_POOL, RK_STATE, RK_RAW, RK_PASSES, RK_WORKER_ID };
enum { FL_REQUEST_ID, FL_RECORD, FL_DONE, FL_TOKENS, FL_SPEC, FL_LOAD, FL_RUNNER, FL_ROUTING,
       FL_RANK };
enum { SP_PROMPT, SP_MAX_TOKENS, SP_EXPECTED, SP_SESSION, SP_TURN, SP_GROUP };
enum { RC_END, RC_STATUS, RC_PROMPT_TOKENS, RC_CACHED_TOKENS, RC_FINISH_REASON, RC_ITL };
enum { SQ_REQUEST_ID, SQ_PROMPT_TOKENS, SQ_CACHED_TOKENS, SQ_FINISH_REASON };
enum { PL_CORE, PL_ROLE, PL_QUEUE, PL_CONFIG };
enum { TM_SPEEDUP, TM_DECODE_SPEEDUP, TM_TOTAL_KV };
static DynSlots rank_slots = DYN_SLOTS_OF(rank_fields), pool_slots = DYN_SLOTS_OF(pool_fields),
                timing_slots = DYN_SLOTS_OF(timing_fields),
                flight_slots = DYN_SLOTS_OF(flight_fields),
                record_slots = DYN_SLOTS_OF(record_fields), seq_slots = DYN_SLOTS_OF(seq_fields),
                spec_slots = DYN_SLOTS_OF(spec_fields);

static PyObject *s_now, *s_next_ready_at, *s_push, *s_apply_events, *s_prefill_completed,
    *s_request_id, *s_retire, *s_has_work, *s_release_held, *s_next_when, *s_pop, *s_popleft,
    *s_done, *s_time_out, *s_mock_pass, *s_vocab_size, *s_excluded, *s_timing, *str_prefill,
    *s_free, *s_ended, *s_decode_text, *str_length, *status_ok, *state_obj[3], *kind_obj[3], *one;

/* The mocker's timing model (dynamo/mocker/timing.py: ``prefill_ms``, ``decode_ms``,
 * ``TimingModel.pass_seconds``, the definition): its coefficients are read from that module. */
static double P2, P1, P0, D2, D1, D0;
static int timing_ready;

typedef struct {
    PyObject *sim, *queue, *timeouts, *counter, *wake, *deliver, *by_id;
    PyObject *now; /* the current instant (strong) */
    long long events;
    /* simulator.py's placeholders of an ended flight's prompt and spec (strong); NULL: every
     * finished request goes through ``sim._retire`` (the simulation decodes text) */
    PyObject *ended_tokens, *ended_spec;
    /* What the scheduler's and the router's thin methods call, read from their modules at the
     * run's start (strong; NULL: those methods are called): ``Scheduler.mock_pass``'s kernel,
     * ``RoutingCore.prefill_completed``'s and ``free``'s functions. The scheduler and router
     * classes found to have those methods unchanged (strong, NULL until one is met). */
    PyObject *kernel, *mark, *free_fn;
    PyObject *sched_type, *core_type;
    PyObject *fields; /* each plain scheduler's and core's fields read (``sched_fields``) */
} Loop;

/* obj.name(args...) with a vectorcall; a new reference or NULL. */
static PyObject *
call_method(PyObject *obj, PyObject *name, PyObject *const *args, size_t n)
{
    PyObject *argv[6];
    argv[0] = obj;
    for (size_t i = 0; i < n; i++)
        argv[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, argv, (n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Calls whose result is not needed: 0, or -1 with an exception. */
static int
done(PyObject *result)
{
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

static int
set_now(Loop *L, PyObject *when)
{
    Py_SETREF(L->now, Py_NewRef(when));
    return PyObject_SetAttr(L->sim, s_now, when);
}

/* The truth of ``obj.name``: 1, 0 or -1. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* The methods whose bodies the loop runs itself (``direct_calls``) as they are defined: captured when
 * the module is imported, so a class whose method was replaced since (a test's monkeypatch, a
 * subclass) is called through the method. */
static PyObject *orig_mock_pass, *orig_has_work, *orig_apply_events, *orig_prefill_completed,
    *orig_free;
static PyObject *s__running, *s__waiting, *s__requests, *s_kv, *s_config, *s_transfer_seconds,
    *s_indexer, *s_apply_in_order, *s_apply_raw, *s_sequences;

/* Whether ``type`` (the class of an object met first) has the attributes ``names`` exactly as
 * ``origs``: 1 or 0 (a lookup error is a difference). */
static int
has_originals(PyObject *type, PyObject *const *names, PyObject *const *origs, int n)
{
    for (int k = 0; k < n; k++) {
        PyObject *a = PyObject_GetAttr(type, names[k]);
        if (a == NULL) {
            PyErr_Clear();
            return 0;
        }
        int same = a == origs[k];
        Py_DECREF(a);
        if (!same)
            return 0;
    }
    return 1;
}

/* Whether ``type`` is ``*known`` or, while no class is known, has the methods ``names`` as
 * ``origs`` (it becomes ``*known``, strong): one class is verified once a run. 1 or 0. */
static int
known_plain(PyObject **known, PyObject *type, PyObject *const *names, PyObject *const *origs,
            int n)
{
    if (type == *known)
        return 1;
    if (*known != NULL || !has_originals(type, names, origs, n))
        return 0;
    *known = Py_NewRef(type);
    return 1;
}

/* Whether ``sched``'s ``mock_pass`` and ``has_work`` are ``Scheduler``'s: then the pass calls
 * the kernel and reads ``_requests`` itself. */
static int
plain_sched(Loop *L, PyObject *sched)
{
    PyObject *names[2] = {s_mock_pass, s_has_work}, *origs[2] = {orig_mock_pass, orig_has_work};
    return L->kernel != NULL &&
           known_plain(&L->sched_type, (PyObject *)Py_TYPE(sched), names, origs, 2);
}

/* Whether ``core``'s ``apply_events``, ``prefill_completed`` and ``free`` are
 * ``RoutingCore``'s. */
static int
plain_core(Loop *L, PyObject *core)
{
    PyObject *names[3] = {s_apply_events, s_prefill_completed, s_free};
    PyObject *origs[3] = {orig_apply_events, orig_prefill_completed, orig_free};
    return L->mark != NULL &&
           known_plain(&L->core_type, (PyObject *)Py_TYPE(core), names, origs, 3);
}

/* ``obj``'s attributes ``names`` as a tuple, read once and kept in ``table`` by ``obj`` (for
 * fields their owner assigns in its ``__init__`` only): borrowed, or NULL with an exception. */
static PyObject *
attrs_once(PyObject *table, PyObject *obj, PyObject *const *names, int n)
{
    PyObject *t = PyDict_GetItemWithError(table, obj);
    if (t != NULL || PyErr_Occurred())
        return t;
    if ((t = PyTuple_New(n)) == NULL)
        return NULL;
    for (int k = 0; k < n; k++) {
        PyObject *v = PyObject_GetAttr(obj, names[k]);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, v);
    }
    int rc = PyDict_SetItem(table, obj, t);
    Py_DECREF(t); /* the table holds it */
    return rc < 0 ? NULL : t;
}

/* A plain router core's fields its thin methods read: ``sequences``, ``indexer`` and the
 * indexer's ``apply_in_order`` (None without an indexer). Read once a run (a core and its
 * indexer assign them in their ``__init__`` only): a borrowed 3-tuple, or NULL with an
 * exception. */
enum { CF_SEQUENCES, CF_INDEXER, CF_APPLIER, CF_N };
static PyObject *
core_fields(Loop *L, PyObject *core)
{
    PyObject *t = PyDict_GetItemWithError(L->fields, core);
    if (t != NULL || PyErr_Occurred())
        return t;
    PyObject *seqs = PyObject_GetAttr(core, s_sequences), *indexer = NULL, *applier = NULL;
    if (seqs == NULL || (indexer = PyObject_GetAttr(core, s_indexer)) == NULL ||
        (applier = indexer == Py_None ? Py_NewRef(Py_None)
                                      : PyObject_GetAttr(indexer, s_apply_in_order)) == NULL ||
        (t = PyTuple_Pack(CF_N, seqs, indexer, applier)) == NULL) {
        Py_XDECREF(seqs);
        Py_XDECREF(indexer);
        Py_XDECREF(applier);
        return NULL;
    }
    Py_DECREF(seqs);
    Py_DECREF(indexer);
    Py_DECREF(applier);
    int rc = PyDict_SetItem(L->fields, core, t);
    Py_DECREF(t); /* the table holds it */
    return rc < 0 ? NULL : t;
}

/* ``core.prefill_completed(rid)`` / ``core.free(rid)`` (``name``), without the method's frame
 * when ``core`` is a plain ``RoutingCore``: ``fn(core.sequences, rid)``, its body. 0, or -1
 * with an exception. */
static int
core_call(Loop *L, PyObject *core, PyObject *name, PyObject *fn, PyObject *rid)
{
    if (!plain_core(L, core))
        return done(call_method(core, name, &rid, 1));
    PyObject *fields = core_fields(L, core);
    if (fields == NULL)
        return -1;
    PyObject *args[2] = {PyTuple_GET_ITEM(fields, CF_SEQUENCES), rid};
    return done(PyObject_Vectorcall(fn, args, 2, NULL));
}

/* ``core.apply_events(worker_id, events)``; a plain ``RoutingCore``'s body for a raw buffer:
 * its indexer's in-order applier, else ``apply_raw``. 0, or -1 with an exception. */
static int
apply_events(Loop *L, PyObject *core, PyObject *wid, PyObject *events)
{
    PyObject *args[2] = {wid, events};
    if (!PyBytes_Check(events) || !plain_core(L, core))
        return done(call_method(core, s_apply_events, args, 2));
    PyObject *fields = core_fields(L, core);
    if (fields == NULL)
        return -1;
    PyObject *indexer = PyTuple_GET_ITEM(fields, CF_INDEXER);
    if (indexer == Py_None)
        return 0;
    PyObject *r = PyObject_Vectorcall(PyTuple_GET_ITEM(fields, CF_APPLIER), args, 2, NULL);
    int applied = r == NULL ? -1 : PyObject_IsTrue(r);
    Py_XDECREF(r);
    return applied < 0 ? -1 : applied ? 0 : done(call_method(indexer, s_apply_raw, args, 2));
}

/* A plain scheduler's fields a pass reads, in ``Scheduler.mock_pass``'s argument order then
 * the sampler's settings and the timing model: ``_running``, ``_waiting``, ``_requests``,
 * ``kv``, ``config``, ``transfer_seconds`` (bound), ``_vocab_size``, ``_excluded``, ``timing``.
 * Read once a run (a scheduler assigns them in its ``__init__`` only and changes the queues in
 * place): a borrowed 9-tuple, or NULL with an exception. */
enum { SF_RUNNING, SF_WAITING, SF_REQUESTS, SF_KV, SF_CONFIG, SF_TRANSFER, SF_VOCAB, SF_EXCLUDED,
       SF_TIMING, SF_N };
static PyObject *
sched_fields(Loop *L, PyObject *sched)
{
    PyObject *const names[SF_N] = {s__running, s__waiting,  s__requests, s_kv,    s_config,
                                   s_transfer_seconds, s_vocab_size, s_excluded, s_timing};
    return attrs_once(L->fields, sched, names, SF_N);
}

/* The truth of ``sched.has_work``: ``Scheduler``'s ``bool(self._requests)`` when plain. */
static int
has_work(Loop *L, PyObject *sched)
{
    if (!plain_sched(L, sched))
        return attr_true(sched, s_has_work);
    PyObject *fields = sched_fields(L, sched);
    return fields == NULL ? -1 : PyObject_IsTrue(PyTuple_GET_ITEM(fields, SF_REQUESTS));
}

/* ``sched.mock_pass(now, vocab, excluded)``; a plain ``Scheduler``'s body (``fields`` not NULL,
 * its ``sched_fields``): its kernel called with the scheduler's queues, KV manager, config and
 * ``transfer_seconds``. */
static PyObject *
mock_pass_of(Loop *L, PyObject *sched, PyObject *fields, PyObject *vocab, PyObject *excluded)
{
    if (fields == NULL) {
        PyObject *args[3] = {L->now, vocab, excluded};
        return call_method(sched, s_mock_pass, args, 3);
    }
    PyObject *const *f = &PyTuple_GET_ITEM(fields, 0);
    PyObject *a[9] = {f[SF_RUNNING], f[SF_WAITING], f[SF_REQUESTS], f[SF_KV], f[SF_CONFIG],
                      L->now,        f[SF_TRANSFER], vocab,         excluded};
    return PyObject_Vectorcall(L->kernel, a, 9, NULL);
}

/* queue.push(when, kind, order, rank) (``order`` stolen). */
static int
push_to(PyObject *queue, PyObject *when, int kind, PyObject *order, PyObject *rank)
{
    if (order == NULL)
        return -1;
    PyObject *args[4] = {when, kind_obj[kind], order, rank};
    int rc = done(call_method(queue, s_push, args, 4));
    Py_DECREF(order);
    return rc;
}

static int
push(Loop *L, PyObject *when, int kind, PyObject *order, PyObject *rank)
{
    return push_to(L->queue, when, kind, order, rank);
}

static int
attr_double(PyObject *obj, PyObject *name, double *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* A TimingModel's field as a double (its slot, or getattr for another class). */
static int
timing_field(PyObject *timing, int f, double *out)
{
    PyObject *v = dyn_slots_get(&timing_slots, timing, f);
    if (v == NULL)
        return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static int
ensure_timing(void)
{
    if (timing_ready)
        return 0;
    PyObject *m = PyImport_ImportModule("dynamo.mocker.timing");
    if (m == NULL)
        return -1;
    PyObject *names[6];
    const char *const texts[6] = {"_P2", "_P1", "_P0", "_D2", "_D1", "_D0"};
    double *const slots[6] = {&P2, &P1, &P0, &D2, &D1, &D0};
    int rc = 0;
    for (int k = 0; k < 6 && rc == 0; k++) {
        names[k] = PyUnicode_FromString(texts[k]);
        rc = names[k] == NULL ? -1 : attr_double(m, names[k], slots[k]);
        Py_XDECREF(names[k]);
    }
    Py_DECREF(m);
    if (rc == 0)
        timing_ready = 1;
    return rc;
}

/* ``timing.pass_seconds(prefill, context, decodes)`` of a ``TimingModel``: the same float
 * operations in the same order (the counts are exact as doubles below 2**53, as Python's
 * int / int and float() of them are). NULL with an exception on a bad argument. */
static PyObject *
timed(PyObject *timing, PyObject *prefill, PyObject *context, PyObject *decodes)
{
    double speedup, decode_speedup, total_kv;
    if (ensure_timing() < 0 || timing_field(timing, TM_SPEEDUP, &speedup) < 0)
        return NULL;
    if (speedup == 0)
        return PyFloat_FromDouble(0.0);
    long long n = PyLong_AsLongLong(prefill);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    long long k = PyLong_AsLongLong(decodes);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    double total = 0.0; /* prefill_ms */
    if (n > 0) {
        double t = (double)n;
        total = P2 * t * t + P1 * t + P0;
    }
    if (k > 0) { /* decode_ms / decode_speedup_ratio */
        long long active = PyLong_AsLongLong(context);
        if ((active == -1 && PyErr_Occurred()) ||
            timing_field(timing, TM_DECODE_SPEEDUP, &decode_speedup) < 0 ||
            timing_field(timing, TM_TOTAL_KV, &total_kv) < 0)
            return NULL;
        double u = total_kv > 0 ? (double)active / total_kv : 1.0;
        double d = D2 * u * u + D1 * u + D0;
        total += (d > 1.0 ? d : 1.0) / decode_speedup;
    }
    return PyFloat_FromDouble(total / speedup / 1000.0);
}

/* ``_pass_start``: the rank's next pass (``MockerScheduler.step`` without its ``StepOutput``:
 * the kernel's 7-tuple is kept in ``rank.raw``, timed here), or it goes idle. */
static int
pass_start(Loop *L, PyObject *rank)
{
    int rc = -1;
    PyObject *sched = dyn_slots_get(&rank_slots, rank, RK_SCHED), *out = NULL, *ready = NULL;
    PyObject *passes = NULL, *when = NULL, *duration = NULL, *vocab = NULL, *excluded = NULL;
    PyObject *timing = NULL, *fields = NULL;
    if (sched == NULL)
        goto end;
    if (plain_sched(L, sched)) { /* its fields read once a run */
        if ((fields = sched_fields(L, sched)) == NULL)
            goto end;
        vocab = Py_NewRef(PyTuple_GET_ITEM(fields, SF_VOCAB));
        excluded = Py_NewRef(PyTuple_GET_ITEM(fields, SF_EXCLUDED));
    }
    else if ((vocab = PyObject_GetAttr(sched, s_vocab_size)) == NULL ||
             (excluded = PyObject_GetAttr(sched, s_excluded)) == NULL)
        goto end;
    if ((out = mock_pass_of(L, sched, fields, vocab, excluded)) == NULL)
        goto end;
    if (!PyTuple_Check(out) || PyTuple_GET_SIZE(out) != 7) {
        PyErr_SetString(PyExc_TypeError, "mock_pass returns a 7-tuple");
        goto end;
    }
    /* (preempted, num_prefill_tokens, num_decodes, decode_context_tokens, tokens, finished,
     *  events); empty (``StepOutput.is_empty``): no prefill token and no decode */
    PyObject *prefill = PyTuple_GET_ITEM(out, 1), *decodes = PyTuple_GET_ITEM(out, 2);
    int no_prefill = PyObject_RichCompareBool(prefill, kind_obj[0], Py_EQ);
    int no_decode =
        no_prefill <= 0 ? no_prefill : PyObject_RichCompareBool(decodes, kind_obj[0], Py_EQ);
    if (no_prefill < 0 || no_decode < 0)
        goto end;
    if (no_prefill && no_decode) {
        if (dyn_slots_put(&rank_slots, rank, RK_STATE, state_obj[R_IDLE]) < 0 ||
            (ready = call_method(sched, s_next_ready_at, NULL, 0)) == NULL)
            goto end;
        if (ready != Py_None) { /* every runnable request waits for its KV transfer */
            int later = PyObject_RichCompareBool(L->now, ready, Py_GT); /* max(ready, now) */
            if (later < 0 || dyn_slots_put(&rank_slots, rank, RK_STATE, state_obj[R_SCHEDULED]) < 0 ||
                push(L, later ? L->now : ready, K_PASS_START, PyIter_Next(L->counter), rank) <
                    0)
                goto end;
        }
        rc = 0;
        goto end;
    }
    timing = fields != NULL ? Py_NewRef(PyTuple_GET_ITEM(fields, SF_TIMING))
                            : PyObject_GetAttr(sched, s_timing);
    if (timing == NULL ||
        (duration = timed(timing, prefill, PyTuple_GET_ITEM(out, 3), decodes)) == NULL ||
        (passes = dyn_slots_get(&rank_slots, rank, RK_PASSES)) == NULL)
        goto end;
    Py_SETREF(passes, PyNumber_Add(passes, one));
    if (passes == NULL || dyn_slots_put(&rank_slots, rank, RK_PASSES, passes) < 0 ||
        dyn_slots_put(&rank_slots, rank, RK_RAW, out) < 0 ||
        dyn_slots_put(&rank_slots, rank, RK_STATE, state_obj[R_BUSY]) < 0 ||
        (when = PyNumber_Add(L->now, duration)) == NULL)
        goto end;
    rc = push(L, when, K_PASS_END, PyIter_Next(L->counter), rank);
end:
    Py_XDECREF(sched);
    Py_XDECREF(out);
    Py_XDECREF(ready);
    Py_XDECREF(passes);
    Py_XDECREF(when);
    Py_XDECREF(duration);
    Py_XDECREF(vocab);
    Py_XDECREF(excluded);
    Py_XDECREF(timing);
    return rc;
}

/* The module-level ``pass_seconds(timing, prefill, context, decodes)``: the C timing, for the
 * test that holds it to ``TimingModel.pass_seconds`` bit for bit. */
static PyObject *
pass_seconds(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "pass_seconds(timing, prefill, context, decodes)");
        return NULL;
    }
    return timed(args[0], args[1], args[2], args[3]);
}

/* The tokens of the pass: ``deliver``, then the router's prefill-completed of each first. */
static int
tokens_of(Loop *L, PyObject *tokens, PyObject *core)
{
    PyObject *args[3] = {tokens, L->by_id, L->now};
    PyObject *firsts = PyObject_Vectorcall(L->deliver, args, 3, NULL);
    if (firsts == NULL)
        return -1;
    int rc = 0;
    if (firsts != Py_None && core != Py_None) {
        PyObject *it = PyObject_GetIter(firsts), *flight;
        if (it == NULL)
            rc = -1;
        while (rc == 0 && it != NULL && (flight = PyIter_Next(it)) != NULL) {
            PyObject *rid = PyObject_GetAttr(flight, s_request_id);
            Py_DECREF(flight);
            rc = rid == NULL ? -1 : core_call(L, core, s_prefill_completed, L->mark, rid);
            Py_XDECREF(rid);
        }
        if (rc == 0 && PyErr_Occurred())
            rc = -1;
        Py_XDECREF(it);
    }
    Py_DECREF(firsts);
    return rc;
}

/* ``record.<f> = v`` with ``v`` stolen (NULL: an error already set): 0 or -1. */
static int
put_record(PyObject *record, int f, PyObject *v)
{
    if (v == NULL)
        return -1;
    int rc = dyn_slots_put(&record_slots, record, f, v);
    Py_DECREF(v);
    return rc;
}

/* A finished request's ITL gaps leave the cyclic collector: a list of floats only (``deliver``
 * appended them), through which no reference cycle can run, and the run keeps one a request,
 * which the first collection after the run traversed with its 31 floats in the benchmark's
 * shape (the record itself is a ``gc=False`` Struct). A list subclass, or a list holding
 * anything but floats, stays tracked. Not a result: the Python loop leaves them tracked. */
static int
untrack_itl(PyObject *record)
{
    PyObject *itl = dyn_slots_get(&record_slots, record, RC_ITL);
    if (itl == NULL)
        return -1;
    if (PyList_CheckExact(itl) && PyObject_GC_IsTracked(itl)) {
        Py_ssize_t n = PyList_GET_SIZE(itl), i = 0;
        while (i < n && PyFloat_CheckExact(PyList_GET_ITEM(itl, i)))
            i++;
        if (i == n)
            PyObject_GC_UnTrack(itl);
    }
    Py_DECREF(itl);
    return 0;
}

/* One finished request of a decode (or aggregated) pass: ``Simulation._retire``'s loop body
 * and ``_finish``, the same writes in the same order; the router's ``free`` and the load
 * generator's ``ended`` are called as there. */
static int
retire_one(Loop *L, PyObject *seq, PyObject *core)
{
    PyObject *rid = dyn_slots_get(&seq_slots, seq, SQ_REQUEST_ID), *flight = NULL;
    PyObject *frid = NULL, *record = NULL, *cached = NULL, *reason = NULL, *load = NULL;
    PyObject *runner = NULL;
    int rc = -1;
    if (rid == NULL)
        return -1;
    flight = PyDict_GetItemWithError(L->by_id, rid); /* by_id.get(seq.request_id) */
    if (flight == NULL) {
        rc = PyErr_Occurred() ? -1 : 0;
        goto end;
    }
    Py_INCREF(flight);
    if ((frid = dyn_slots_get(&flight_slots, flight, FL_REQUEST_ID)) == NULL ||
        (core != Py_None && core_call(L, core, s_free, L->free_fn, frid) < 0) ||
        (record = dyn_slots_get(&flight_slots, flight, FL_RECORD)) == NULL ||
        dyn_slots_put(&record_slots, record, RC_END, L->now) < 0 ||
        dyn_slots_put(&record_slots, record, RC_STATUS, status_ok) < 0 ||
        put_record(record, RC_PROMPT_TOKENS, dyn_slots_get(&seq_slots, seq, SQ_PROMPT_TOKENS)) < 0 ||
        (cached = dyn_slots_get(&record_slots, record, RC_CACHED_TOKENS)) == NULL)
        goto end;
    if (cached == Py_None) { /* seq.num_cached_tokens or 0 */
        PyObject *n = dyn_slots_get(&seq_slots, seq, SQ_CACHED_TOKENS);
        int truth = n == NULL ? -1 : PyObject_IsTrue(n);
        if (truth == 0)
            Py_SETREF(n, Py_NewRef(kind_obj[0]));
        if (truth < 0 || put_record(record, RC_CACHED_TOKENS, n) < 0) {
            if (truth < 0)
                Py_XDECREF(n);
            goto end;
        }
    }
    if ((reason = dyn_slots_get(&seq_slots, seq, SQ_FINISH_REASON)) == NULL ||
        put_record(record, RC_FINISH_REASON,
                   reason == Py_None ? Py_NewRef(str_length) : PyObject_Str(reason)) < 0 ||
        untrack_itl(record) < 0)
        goto end;
    /* _finish: done, forgotten, its prompt and spec dropped, its load phase goes on */
    if (dyn_slots_put(&flight_slots, flight, FL_DONE, Py_True) < 0 ||
        PyDict_DelItem(L->by_id, frid) < 0 ||
        dyn_slots_put(&flight_slots, flight, FL_TOKENS, L->ended_tokens) < 0 ||
        dyn_slots_put(&flight_slots, flight, FL_SPEC, L->ended_spec) < 0 ||
        (load = dyn_slots_get(&flight_slots, flight, FL_LOAD)) == NULL ||
        (runner = dyn_slots_get(&flight_slots, flight, FL_RUNNER)) == NULL)
        goto end;
    Py_SETREF(record, dyn_slots_get(&flight_slots, flight, FL_RECORD));
    if (record == NULL)
        goto end;
    PyObject *args[3] = {runner, record, L->now};
    rc = done(call_method(load, s_ended, args, 3));
end:
    Py_DECREF(rid);
    Py_XDECREF(flight);
    Py_XDECREF(frid);
    Py_XDECREF(record);
    Py_XDECREF(cached);
    Py_XDECREF(reason);
    Py_XDECREF(load);
    Py_XDECREF(runner);
    return rc;
}

/* The finished requests of a pass: here for a decode pool when no text is decoded, else
 * ``sim._retire`` (a prefill moves on to its decode worker; text is decoded in Python). */
static int
retire(Loop *L, PyObject *rank, PyObject *finished, PyObject *core, int prefill_pool)
{
    if (prefill_pool || L->ended_tokens == NULL || !PyDict_CheckExact(L->by_id)) {
        PyObject *args[2] = {rank, finished};
        return done(call_method(L->sim, s_retire, args, 2));
    }
    PyObject *it = PyObject_GetIter(finished), *seq;
    if (it == NULL)
        return -1;
    int rc = 0;
    while (rc == 0 && (seq = PyIter_Next(it)) != NULL) {
        rc = retire_one(L, seq, core);
        Py_DECREF(seq);
    }
    Py_DECREF(it);
    return rc == 0 && PyErr_Occurred() ? -1 : rc;
}

/* ``_pass_end``: the pass's outcome, then the rank's next pass (inline when nothing else is
 * due at this instant). */
static int
pass_end(Loop *L, PyObject *rank)
{
    int rc = -1;
    PyObject *out = dyn_slots_get(&rank_slots, rank, RK_RAW), *pool = NULL, *core = NULL;
    PyObject *role = NULL, *held_queue = NULL, *sched = NULL, *order = NULL;
    if (out == NULL || dyn_slots_put(&rank_slots, rank, RK_RAW, Py_None) < 0)
        goto end;
    if (!PyTuple_Check(out) || PyTuple_GET_SIZE(out) != 7) {
        PyErr_SetString(PyExc_TypeError, "a running pass is mock_pass's 7-tuple");
        goto end;
    }
    PyObject *tokens = PyTuple_GET_ITEM(out, 4), *finished = PyTuple_GET_ITEM(out, 5);
    PyObject *events = PyTuple_GET_ITEM(out, 6);
    if ((pool = dyn_slots_get(&rank_slots, rank, RK_POOL)) == NULL ||
        (core = dyn_slots_get(&pool_slots, pool, PL_CORE)) == NULL)
        goto end;
    if (core != Py_None) {
        int any = PyObject_IsTrue(events);
        if (any < 0)
            goto end;
        if (any) {
            PyObject *wid = dyn_slots_get(&rank_slots, rank, RK_WORKER_ID);
            if (wid == NULL)
                goto end;
            int r = apply_events(L, core, wid, events);
            Py_DECREF(wid);
            if (r < 0)
                goto end;
        }
    }
    if ((role = dyn_slots_get(&pool_slots, pool, PL_ROLE)) == NULL)
        goto end;
    int prefill_pool = PyObject_RichCompareBool(role, str_prefill, Py_EQ);
    if (prefill_pool < 0 || (!prefill_pool && tokens_of(L, tokens, core) < 0))
        goto end;
    int any_finished = PyObject_IsTrue(finished);
    if (any_finished < 0)
        goto end;
    if (any_finished && retire(L, rank, finished, core, prefill_pool) < 0)
        goto end;
    if ((held_queue = dyn_slots_get(&pool_slots, pool, PL_QUEUE)) == NULL)
        goto end;
    int held = 0;
    if (held_queue != Py_None && !prefill_pool) {
        Py_ssize_t n = PyObject_Length(held_queue);
        if (n < 0)
            goto end;
        held = n > 0;
    }
    if ((sched = dyn_slots_get(&rank_slots, rank, RK_SCHED)) == NULL)
        goto end;
    int work = has_work(L, sched);
    if (work < 0)
        goto end;
    if (!work) {
        if (dyn_slots_put(&rank_slots, rank, RK_STATE, state_obj[R_IDLE]) < 0 ||
            (held && done(call_method(L->sim, s_release_held, NULL, 0)) < 0))
            goto end;
        rc = 0;
        goto end;
    }
    /* The next pass starts now, after every arrival and pass end of this instant and after the
     * pass starts already due (its place in the FIFO is taken here, as a push would). */
    if (dyn_slots_put(&rank_slots, rank, RK_STATE, state_obj[R_SCHEDULED]) < 0 ||
        (order = PyIter_Next(L->counter)) == NULL ||
        (held && done(call_method(L->sim, s_release_held, NULL, 0)) < 0))
        goto end;
    PyObject *next = call_method(L->queue, s_next_when, NULL, 0);
    if (next == NULL)
        goto end;
    int due = PyObject_RichCompareBool(next, L->now, Py_LE);
    Py_DECREF(next);
    if (due < 0)
        goto end;
    if (due) { /* more is due at this instant: the pass waits its turn */
        rc = push(L, L->now, K_PASS_START, order, rank);
        order = NULL;
    }
    else { /* nothing else is due now: the pop would be the very next event */
        L->events++;
        rc = pass_start(L, rank);
    }
end:
    Py_XDECREF(out);
    Py_XDECREF(pool);
    Py_XDECREF(core);
    Py_XDECREF(role);
    Py_XDECREF(held_queue);
    Py_XDECREF(sched);
    Py_XDECREF(order);
    return rc;
}

/* A request deadline due before the next event: 1 if one was handled, 0 if none, -1. */
static int
deadline(Loop *L)
{
    Py_ssize_t n = PyObject_Length(L->timeouts);
    if (n <= 0)
        return n < 0 ? -1 : 0;
    PyObject *head = PySequence_GetItem(L->timeouts, 0);
    if (head == NULL)
        return -1;
    PyObject *when = PySequence_GetItem(head, 0);
    Py_DECREF(head);
    if (when == NULL)
        return -1;
    PyObject *next = call_method(L->queue, s_next_when, NULL, 0);
    int before = next == NULL ? -1 : PyObject_RichCompareBool(when, next, Py_LT);
    Py_DECREF(when);
    Py_XDECREF(next);
    if (before <= 0)
        return before;
    PyObject *item = call_method(L->timeouts, s_popleft, NULL, 0);
    if (item == NULL)
        return -1;
    int rc = -1;
    PyObject *flight = NULL;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
        PyErr_SetString(PyExc_TypeError, "a deadline is a (when, flight) pair");
        goto end;
    }
    flight = PyTuple_GET_ITEM(item, 1);
    int finished = attr_true(flight, s_done);
    if (finished < 0)
        goto end;
    if (!finished && (set_now(L, PyTuple_GET_ITEM(item, 0)) < 0 ||
                      done(call_method(L->sim, s_time_out, &flight, 1)) < 0))
        goto end;
    rc = 1;
end:
    Py_DECREF(item);
    return rc;
}

static int
dispatch(Loop *L)
{
    PyObject *event = call_method(L->queue, s_pop, NULL, 0);
    if (event == NULL)
        return -1;
    int rc = -1;
    if (!PyTuple_Check(event) || PyTuple_GET_SIZE(event) != 3) {
        PyErr_SetString(PyExc_TypeError, "an event is a (when, kind, payload) triple");
        goto end;
    }
    if (set_now(L, PyTuple_GET_ITEM(event, 0)) < 0)
        goto end;
    L->events++;
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(event, 1));
    if (kind == -1 && PyErr_Occurred())
        goto end;
    PyObject *payload = PyTuple_GET_ITEM(event, 2);
    if (kind == K_PASS_END)
        rc = pass_end(L, payload);
    else if (kind == K_PASS_START)
        rc = pass_start(L, payload);
    else
        rc = done(PyObject_CallOneArg(L->wake, payload));
end:
    Py_DECREF(event);
    return rc;
}

/* Whether finished requests are retired here (the simulation decodes no text): then the
 * placeholders an ended flight's prompt and spec become, simulator.py's ``_ENDED`` and
 * ``_ENDED_SPEC``. 0, or -1 with an exception. */
static int
ended_placeholders(Loop *L)
{
    PyObject *decode = PyObject_GetAttr(L->sim, s_decode_text);
    if (decode == NULL)
        return -1;
    int text = decode != Py_None;
    Py_DECREF(decode);
    if (text)
        return 0;
    L->ended_tokens = dyn_import_attr("dynamo.replay.simulator", "_ENDED");
    L->ended_spec =
        L->ended_tokens ? dyn_import_attr("dynamo.replay.simulator", "_ENDED_SPEC") : NULL;
    return L->ended_spec == NULL ? -1 : 0;
}

/* The functions the thin methods call (``Loop``'s ``kernel``, ``mark``, ``free_fn``), looked up in
 * their modules as the methods look them up: 0, or -1 with an exception. */
static int
direct_calls(Loop *L)
{
    return (L->kernel = dyn_import_attr("dynamo.engine_core.scheduler", "mock_pass")) == NULL ||
                   (L->mark = dyn_import_attr("dynamo.router.core", "mark_prefill_completed")) ==
                       NULL ||
                   (L->free_fn = dyn_import_attr("dynamo.router.core", "free")) == NULL
               ? -1
               : 0;
}

/* The methods the loop and the send run the bodies of, as defined (module import):
 * ``Scheduler``'s, ``RoutingCore``'s and ``SharedPrefixHasher``'s (``hasher_type``). 0 or -1. */
static PyObject *orig_hashes, *orig_enqueue, *hasher_type, *s_hashes, *s_enqueue;

static int
capture_originals(void)
{
    PyObject *sched = NULL, *core = NULL;
    int rc = (sched = dyn_import_attr("dynamo.engine_core.scheduler", "Scheduler")) == NULL ||
                     (orig_mock_pass = PyObject_GetAttr(sched, s_mock_pass)) == NULL ||
                     (orig_has_work = PyObject_GetAttr(sched, s_has_work)) == NULL ||
                     (orig_enqueue = PyObject_GetAttr(sched, s_enqueue)) == NULL ||
                     (core = dyn_import_attr("dynamo.router.core", "RoutingCore")) == NULL ||
                     (orig_apply_events = PyObject_GetAttr(core, s_apply_events)) == NULL ||
                     (orig_prefill_completed = PyObject_GetAttr(core, s_prefill_completed)) ==
                         NULL ||
                     (orig_free = PyObject_GetAttr(core, s_free)) == NULL ||
                     (hasher_type = dyn_import_attr("dynamo.router.hashing",
                                                    "SharedPrefixHasher")) == NULL ||
                     (orig_hashes = PyObject_GetAttr(hasher_type, s_hashes)) == NULL
                 ? -1
                 : 0;
    Py_XDECREF(sched);
    Py_XDECREF(core);
    return rc;
}

static PyObject *
run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "run(sim, queue, timeouts, counter, wake, deliver)");
        return NULL;
    }
    Loop L = {args[0], args[1], args[2], args[3], args[4], args[5], NULL, NULL, 0, NULL, NULL,
              NULL, NULL, NULL, NULL, NULL, NULL};
    if ((L.by_id = PyObject_GetAttrString(L.sim, "_by_id")) == NULL)
        return NULL;
    if ((L.now = PyObject_GetAttr(L.sim, s_now)) == NULL) {
        Py_DECREF(L.by_id);
        return NULL;
    }
    int rc = ended_placeholders(&L) < 0 || direct_calls(&L) < 0 ||
                     (L.fields = PyDict_New()) == NULL
                 ? -1
                 : 0;
    for (; rc == 0;) {
        Py_ssize_t queued = PyObject_Length(L.queue), waiting = PyObject_Length(L.timeouts);
        if (queued < 0 || waiting < 0) {
            rc = -1;
            break;
        }
        if (queued == 0 && waiting == 0)
            break;
        int r = deadline(&L);
        if (r == 0)
            r = dispatch(&L);
        if (r < 0) {
            rc = -1;
            break;
        }
    }
    Py_DECREF(L.by_id);
    Py_DECREF(L.now);
    Py_XDECREF(L.ended_tokens);
    Py_XDECREF(L.ended_spec);
    Py_XDECREF(L.kernel);
    Py_XDECREF(L.mark);
    Py_XDECREF(L.free_fn);
    Py_XDECREF(L.sched_type);
    Py_XDECREF(L.core_type);
    Py_XDECREF(L.fields);
    return rc < 0 ? NULL : PyLong_FromLongLong(L.events);
}


/* -- the common send ------------------------------------------------------------------------ */

/* ``sender(sim)``: ``Simulation._send`` with ``_arrive``, ``_route`` (the pool's ``route``
 * within it), ``_sequence`` and ``_enqueue``, for a simulation whose every send takes that one
 * path: no frontend model, no router queue, aggregated workers behind the KV router
 * (``Simulation._phase`` gives one to the phase's load generator then). The same calls on the
 * collaborators in the same order, so the same records, routing and events
 * (tests/unit/replay/test_loop_native.py compares whole runs with the Python path); a prompt
 * that is neither a list nor an array goes to ``sim._send``, which refuses it. Why native: these were six Python
 * frames a request (docs/performance.md, "Offline replay"). It keeps no flight: ``sim.flights``
 * is read at each send (a run hands that list to its result and the simulation keeps none). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *sim, *prefix, *by_id, *timeouts, *hasher, *core, *ranks, *queue, *counter;
    PyObject *record_type, *flight_type, *routing_type, *new_sequence, *dynamo_error;
    /* ``SharedPrefixHasher.hashes``'s body run here when the hasher is a plain one (its
     * ``_last`` table, block size, seed and the two hash functions it calls); NULL: called */
    PyObject *last, *block_size, *seed, *plain_pair, *pair_after;
    PyObject *sched_type; /* a scheduler class whose ``enqueue`` is Scheduler's (strong) */
    PyObject *queues;     /* each such scheduler's (_requests, _waiting), read once */
    /* the last load generator seen (a weak reference: it holds this sender) and its
     * ``load.timeout_s`` */
    PyObject *phase, *timeout;
} Sender;

static PyObject *s_flights, *s_send, *s_route, *s_worker_id, *s_dp_rank,
    *s_overlap_blocks, *s_cost, *s_fail, *s_load, *s_timeout_s, *s_append,
    *kw_route, *kw_sequence;

static PyObject *s__last, *s__seed, *s_block_size;

/* ``sim._hasher.hashes(tokens, key)`` (``key`` None: nothing kept or reused). */
static PyObject *
prompt_hashes_of(Sender *S, PyObject *tokens, PyObject *key)
{
    if (S->last == NULL) {
        PyObject *args[2] = {tokens, key};
        return call_method(S->hasher, s_hashes, args, 2);
    }
    PyObject *last = key == Py_None ? NULL : PyDict_GetItemWithError(S->last, key);
    if (last == NULL && PyErr_Occurred())
        return NULL;
    PyObject *pair;
    if (last == NULL) {
        PyObject *args[3] = {tokens, S->block_size, S->seed};
        pair = PyObject_Vectorcall(S->plain_pair, args, 3, NULL);
    }
    else {
        if (!PyTuple_Check(last) || PyTuple_GET_SIZE(last) != 3) {
            PyErr_SetString(PyExc_TypeError, "a hasher's last prompt is a 3-tuple");
            return NULL;
        }
        PyObject *args[6] = {tokens,
                             S->block_size,
                             S->seed,
                             PyTuple_GET_ITEM(last, 0),
                             PyTuple_GET_ITEM(last, 1),
                             PyTuple_GET_ITEM(last, 2)};
        pair = PyObject_Vectorcall(S->pair_after, args, 6, NULL);
    }
    if (pair == NULL)
        return NULL;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "prompt hashes are a (local, chained) pair");
        return NULL;
    }
    if (key != Py_None) { /* tuples: the returned lists are the caller's to change */
        PyObject *local = PySequence_Tuple(PyTuple_GET_ITEM(pair, 0));
        PyObject *chained = local ? PySequence_Tuple(PyTuple_GET_ITEM(pair, 1)) : NULL;
        PyObject *entry = chained ? PyTuple_Pack(3, tokens, local, chained) : NULL;
        int rc = entry == NULL ? -1 : PyDict_SetItem(S->last, key, entry);
        Py_XDECREF(local);
        Py_XDECREF(chained);
        Py_XDECREF(entry);
        if (rc < 0)
            Py_CLEAR(pair);
    }
    return pair;
}

/* ``sched.enqueue(seq)`` (``seq`` fresh from ``new_sequence``, ``rid`` its id): a plain
 * ``Scheduler``'s body here (into ``_requests`` and the back of ``_waiting``), unless the id is
 * queued already (the method raises). 0, or -1 with an exception. */
static int
enqueue(Sender *S, PyObject *sched, PyObject *seq, PyObject *rid)
{
    PyObject *names[1] = {s_enqueue}, *origs[1] = {orig_enqueue};
    if (!known_plain(&S->sched_type, (PyObject *)Py_TYPE(sched), names, origs, 1))
        return done(call_method(sched, s_enqueue, &seq, 1));
    /* its queues, read once (a scheduler assigns them in its __init__ only) */
    PyObject *queue_names[2] = {s__requests, s__waiting};
    PyObject *q = attrs_once(S->queues, sched, queue_names, 2);
    if (q == NULL)
        return -1;
    PyObject *requests = PyTuple_GET_ITEM(q, 0), *waiting = PyTuple_GET_ITEM(q, 1);
    int known = PyDict_Check(requests) ? PyDict_Contains(requests, rid) : 1;
    if (known != 0) /* a duplicate (or an unusual table): the method decides */
        return known < 0 ? -1 : done(call_method(sched, s_enqueue, &seq, 1));
    if (PyDict_SetItem(requests, rid, seq) < 0)
        return -1;
    return done(call_method(waiting, s_append, &seq, 1));
}

static PyObject *array_type; /* array.array: a packed prompt */

/* The send's ``except DynamoError as exc: self._fail(flight, exc)``: 0 when it was one and
 * ``_fail`` ran, -1 with the exception otherwise. */
static int
fail_with(Sender *S, PyObject *flight)
{
    if (!PyErr_ExceptionMatches(S->dynamo_error))
        return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *args[2] = {flight, value};
    int rc = done(call_method(S->sim, s_fail, args, 2));
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return rc;
}

/* ``_route`` from the pool's route on (``hashes`` the prompt's, ``v`` the spec's fields), then
 * ``_enqueue``: 0, or -1 with an exception. */
static int
route_and_enqueue(Sender *S, PyObject *flight, PyObject *rid, PyObject *prompt, PyObject *now,
                  PyObject *hashes, PyObject *max_tokens)
{
    int rc = -1;
    PyObject *isl = NULL, *chosen = NULL, *wid = NULL, *dpr = NULL, *overlap = NULL;
    PyObject *cost = NULL, *out = NULL, *key = NULL, *rank = NULL, *pool = NULL, *config = NULL;
    PyObject *seq = NULL, *sched = NULL, *state = NULL;
    if (!PyTuple_Check(hashes) || PyTuple_GET_SIZE(hashes) != 2) {
        PyErr_SetString(PyExc_TypeError, "the prompt's hashes are a (local, sequence) pair");
        return -1;
    }
    Py_ssize_t len = PyObject_Length(prompt);
    if (len < 0 || (isl = PyLong_FromSsize_t(len)) == NULL)
        return -1;
    /* core.route(request_id, local, len(tokens), seq_hashes=seqs) */
    PyObject *rargs[5] = {S->core, rid, PyTuple_GET_ITEM(hashes, 0), isl,
                          PyTuple_GET_ITEM(hashes, 1)};
    chosen = PyObject_VectorcallMethod(s_route, rargs, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, kw_route);
    if (chosen == NULL)
        goto failed;
    if ((wid = PyObject_GetAttr(chosen, s_worker_id)) == NULL ||
        (dpr = PyObject_GetAttr(chosen, s_dp_rank)) == NULL ||
        (overlap = PyObject_GetAttr(chosen, s_overlap_blocks)) == NULL ||
        (cost = PyObject_GetAttr(chosen, s_cost)) == NULL)
        goto failed;
    PyObject *oargs[4] = {wid, dpr, overlap, cost};
    if ((out = PyObject_Vectorcall(S->routing_type, oargs, 4, NULL)) == NULL ||
        (key = PyTuple_Pack(2, wid, dpr)) == NULL ||
        (rank = PyObject_GetItem(S->ranks, key)) == NULL ||
        dyn_slots_put(&flight_slots, flight, FL_ROUTING, out) < 0 ||
        (pool = dyn_slots_get(&rank_slots, rank, RK_POOL)) == NULL ||
        (config = dyn_slots_get(&pool_slots, pool, PL_CONFIG)) == NULL)
        goto failed;
    /* new_sequence(config, tokens, request_id, now, max_tokens=..., ignore_eos=True,
     *              handoff=None, hashes=hashes) */
    PyObject *nargs[8] = {config, prompt, rid, now, max_tokens, Py_True, Py_None, hashes};
    if ((seq = PyObject_Vectorcall(S->new_sequence, nargs, 4, kw_sequence)) == NULL)
        goto failed;
    /* _enqueue */
    if (dyn_slots_put(&flight_slots, flight, FL_RANK, rank) < 0 ||
        (sched = dyn_slots_get(&rank_slots, rank, RK_SCHED)) == NULL ||
        enqueue(S, sched, seq, rid) < 0 ||
        (state = dyn_slots_get(&rank_slots, rank, RK_STATE)) == NULL)
        goto end;
    int idle = PyObject_RichCompareBool(state, state_obj[R_IDLE], Py_EQ);
    if (idle < 0)
        goto end;
    if (idle && (dyn_slots_put(&rank_slots, rank, RK_STATE, state_obj[R_SCHEDULED]) < 0 ||
                 push_to(S->queue, now, K_PASS_START, PyIter_Next(S->counter), rank) < 0))
        goto end;
    rc = 0;
    goto end;
failed: /* inside _route's try: a DynamoError fails the request */
    rc = fail_with(S, flight);
end:
    Py_XDECREF(isl);
    Py_XDECREF(chosen);
    Py_XDECREF(wid);
    Py_XDECREF(dpr);
    Py_XDECREF(overlap);
    Py_XDECREF(cost);
    Py_XDECREF(out);
    Py_XDECREF(key);
    Py_XDECREF(rank);
    Py_XDECREF(pool);
    Py_XDECREF(config);
    Py_XDECREF(seq);
    Py_XDECREF(sched);
    Py_XDECREF(state);
    return rc;
}

/* ``send(spec, runner, load)``: see ``Sender``. */
static PyObject *
sender_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Sender *S = (Sender *)self;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "send(spec, runner, load)");
        return NULL;
    }
    PyObject *spec = args[0], *runner = args[1], *load = args[2];
    PyObject *prompt = dyn_slots_get(&spec_slots, spec, SP_PROMPT);
    if (prompt == NULL)
        return NULL;
    if (!PyList_Check(prompt) && !PyObject_TypeCheck(prompt, (PyTypeObject *)array_type)) {
        /* refused by the Python path */
        Py_DECREF(prompt);
        return call_method(S->sim, s_send, args, 3);
    }
    int rc = -1;
    PyObject *v[5] = {NULL}; /* max_tokens, expected_prompt_tokens, session, turn, group */
    PyObject *now = NULL, *flights = NULL, *record = NULL, *rid = NULL, *index = NULL;
    PyObject *flight = NULL, *phase = NULL, *timeout = NULL, *hashes = NULL;
    if ((now = PyObject_GetAttr(S->sim, s_now)) == NULL ||
        (flights = PyObject_GetAttr(S->sim, s_flights)) == NULL)
        goto end;
    if (!PyList_Check(flights)) {
        PyErr_SetString(PyExc_TypeError, "the simulation's flights are a list");
        goto end;
    }
    for (int k = 0; k < 5; k++)
        if ((v[k] = dyn_slots_get(&spec_slots, spec, SP_MAX_TOKENS + k)) == NULL)
            goto end;
    Py_ssize_t n = PyList_GET_SIZE(flights);
    PyObject *rargs[6] = {now, v[0], v[1], v[2], v[3], v[4]}; /* RequestRecord's first six */
    if ((record = PyObject_Vectorcall(S->record_type, rargs, 6, NULL)) == NULL ||
        (rid = PyUnicode_FromFormat("%U-%zd", S->prefix, n)) == NULL ||
        (index = PyLong_FromSsize_t(n)) == NULL)
        goto end;
    PyObject *fargs[7] = {index, rid, record, spec, runner, load, prompt};
    if ((flight = PyObject_Vectorcall(S->flight_type, fargs, 7, NULL)) == NULL ||
        PyList_Append(flights, flight) < 0 || PyDict_SetItem(S->by_id, rid, flight) < 0)
        goto end;
    if (S->phase == NULL || PyWeakref_GET_OBJECT(S->phase) != load) {
        /* a generator's load (a LoadSpec) is its own: read once a generator */
        PyObject *ref = NULL;
        if ((phase = PyObject_GetAttr(load, s_load)) == NULL ||
            (timeout = PyObject_GetAttr(phase, s_timeout_s)) == NULL)
            goto end;
        if ((ref = PyWeakref_NewRef(load, NULL)) == NULL)
            PyErr_Clear(); /* not weakly referable: read at each send */
        Py_XSETREF(S->phase, ref);
        Py_XSETREF(S->timeout, Py_NewRef(timeout));
    }
    else
        timeout = Py_NewRef(S->timeout);
    if (timeout != Py_None) { /* the request's deadline */
        PyObject *when = PyNumber_Add(now, timeout);
        PyObject *pair = when == NULL ? NULL : PyTuple_Pack(2, when, flight);
        Py_XDECREF(when);
        int r = pair == NULL ? -1 : done(call_method(S->timeouts, s_append, &pair, 1));
        Py_XDECREF(pair);
        if (r < 0)
            goto end;
    }
    /* _arrive: hashed (keyed by its prefix group, if any), then routed */
    int grouped = PyObject_RichCompareBool(v[4], kind_obj[0], Py_GE);
    if (grouped < 0)
        goto end;
    if ((hashes = prompt_hashes_of(S, prompt, grouped ? v[4] : Py_None)) == NULL)
        goto end;
    rc = route_and_enqueue(S, flight, rid, prompt, now, hashes, v[0]);
end:
    Py_DECREF(prompt);
    for (int k = 0; k < 5; k++)
        Py_XDECREF(v[k]);
    Py_XDECREF(now);
    Py_XDECREF(flights);
    Py_XDECREF(record);
    Py_XDECREF(rid);
    Py_XDECREF(index);
    Py_XDECREF(flight);
    Py_XDECREF(phase);
    Py_XDECREF(timeout);
    Py_XDECREF(hashes);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

static int
sender_traverse(Sender *S, visitproc visit, void *arg)
{
    Py_VISIT(S->sim);
    Py_VISIT(S->prefix);
    Py_VISIT(S->by_id);
    Py_VISIT(S->timeouts);
    Py_VISIT(S->hasher);
    Py_VISIT(S->core);
    Py_VISIT(S->ranks);
    Py_VISIT(S->queue);
    Py_VISIT(S->counter);
    Py_VISIT(S->record_type);
    Py_VISIT(S->flight_type);
    Py_VISIT(S->routing_type);
    Py_VISIT(S->new_sequence);
    Py_VISIT(S->dynamo_error);
    Py_VISIT(S->last);
    Py_VISIT(S->block_size);
    Py_VISIT(S->seed);
    Py_VISIT(S->plain_pair);
    Py_VISIT(S->pair_after);
    Py_VISIT(S->sched_type);
    Py_VISIT(S->queues);
    Py_VISIT(S->phase);
    Py_VISIT(S->timeout);
    return 0;
}

static int
sender_clear(Sender *S)
{
    Py_CLEAR(S->sim);
    Py_CLEAR(S->prefix);
    Py_CLEAR(S->by_id);
    Py_CLEAR(S->timeouts);
    Py_CLEAR(S->hasher);
    Py_CLEAR(S->core);
    Py_CLEAR(S->ranks);
    Py_CLEAR(S->queue);
    Py_CLEAR(S->counter);
    Py_CLEAR(S->record_type);
    Py_CLEAR(S->flight_type);
    Py_CLEAR(S->routing_type);
    Py_CLEAR(S->new_sequence);
    Py_CLEAR(S->dynamo_error);
    Py_CLEAR(S->last);
    Py_CLEAR(S->block_size);
    Py_CLEAR(S->seed);
    Py_CLEAR(S->plain_pair);
    Py_CLEAR(S->pair_after);
    Py_CLEAR(S->sched_type);
    Py_CLEAR(S->queues);
    Py_CLEAR(S->phase);
    Py_CLEAR(S->timeout);
    return 0;
}

static void
sender_dealloc(Sender *S)
{
    PyObject_GC_UnTrack(S);
    sender_clear(S);
    PyObject_GC_Del(S);
}

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dynamo.replay._loop.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Sender, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)sender_traverse,
    .tp_clear = (inquiry)sender_clear,
    .tp_dealloc = (destructor)sender_dealloc,
    .tp_doc = "send(spec, runner, load): Simulation._send's common path (see sender()).",
};

/* ``sim``'s attribute ``name`` into *slot (a new reference): 0, or -1 with an exception. */
static int
take_attr(PyObject *obj, const char *name, PyObject **slot)
{
    return (*slot = PyObject_GetAttrString(obj, name)) == NULL ? -1 : 0;
}

/* A plain ``SharedPrefixHasher`` (its ``hashes`` as defined, a positive block size): its
 * table, block size, seed and hash functions for ``prompt_hashes_of``. 0, or -1 with an
 * exception; S->last stays NULL (the method is called) for any other hasher. */
static int
plain_hasher(Sender *S)
{
    PyObject *names[1] = {s_hashes}, *origs[1] = {orig_hashes};
    if (!has_originals((PyObject *)Py_TYPE(S->hasher), names, origs, 1))
        return 0;
    PyObject *m = PyImport_ImportModule("dynamo.router.hashing");
    if (m == NULL)
        return -1;
    PyObject *last = NULL, *size = NULL, *seed = NULL, *plain = NULL, *after = NULL;
    int rc = -1;
    if ((last = PyObject_GetAttr(S->hasher, s__last)) == NULL ||
        (size = PyObject_GetAttr(S->hasher, s_block_size)) == NULL ||
        (seed = PyObject_GetAttr(S->hasher, s__seed)) == NULL ||
        (plain = PyObject_GetAttrString(m, "_plain_pair")) == NULL ||
        (after = PyObject_GetAttrString(m, "_pair_after")) == NULL)
        goto end;
    rc = 0;
    long bs = PyLong_Check(size) ? PyLong_AsLong(size) : 0;
    if (bs == -1 && PyErr_Occurred())
        PyErr_Clear();
    else if (bs > 0 && PyDict_CheckExact(last)) { /* else: the method (no blocks: empty) */
        S->last = Py_NewRef(last), S->block_size = Py_NewRef(size), S->seed = Py_NewRef(seed);
        S->plain_pair = Py_NewRef(plain), S->pair_after = Py_NewRef(after);
    }
end:
    Py_DECREF(m);
    Py_XDECREF(last);
    Py_XDECREF(size);
    Py_XDECREF(seed);
    Py_XDECREF(plain);
    Py_XDECREF(after);
    return rc;
}

static PyObject *
sender(PyObject *module, PyObject *sim)
{
    Sender *S = PyObject_GC_New(Sender, &SenderType);
    if (S == NULL)
        return NULL;
    S->vectorcall = sender_call;
    S->sim = Py_NewRef(sim);
    S->prefix = S->by_id = S->timeouts = S->hasher = S->core = S->ranks = S->queue = NULL;
    S->counter = S->record_type = S->flight_type = S->routing_type = NULL;
    S->new_sequence = S->dynamo_error = NULL;
    S->last = S->block_size = S->seed = S->plain_pair = S->pair_after = S->sched_type = NULL;
    S->phase = S->timeout = NULL;
    if ((S->queues = PyDict_New()) == NULL) {
        Py_DECREF(S);
        return NULL;
    }
    PyObject_GC_Track(S);
    PyObject *pool = NULL, *m = NULL;
    int rc = -1;
    if (take_attr(sim, "_prefix", &S->prefix) < 0 || take_attr(sim, "_by_id", &S->by_id) < 0 ||
        take_attr(sim, "_timeouts", &S->timeouts) < 0 ||
        take_attr(sim, "_hasher", &S->hasher) < 0 ||
        take_attr(sim, "_events_queue", &S->queue) < 0 ||
        take_attr(sim, "_counter", &S->counter) < 0 ||
        take_attr(sim, "decode_pool", &pool) < 0 || take_attr(pool, "core", &S->core) < 0 ||
        take_attr(pool, "ranks", &S->ranks) < 0)
        goto end;
    if (!PyUnicode_CheckExact(S->prefix) || !PyDict_CheckExact(S->by_id)) {
        PyErr_SetString(PyExc_TypeError, "a simulation's id prefix is a str, _by_id a dict");
        goto end;
    }
    /* the names simulator.py's _send path calls */
    if ((m = PyImport_ImportModule("dynamo.replay.simulator")) == NULL ||
        take_attr(m, "RequestRecord", &S->record_type) < 0 ||
        take_attr(m, "Flight", &S->flight_type) < 0 ||
        take_attr(m, "RoutingRecord", &S->routing_type) < 0 ||
        take_attr(m, "new_sequence", &S->new_sequence) < 0 ||
        take_attr(m, "DynamoError", &S->dynamo_error) < 0)
        goto end;
    if (Py_IS_TYPE(S->hasher, (PyTypeObject *)hasher_type) && plain_hasher(S) < 0)
        goto end;
    rc = 0;
end:
    Py_XDECREF(pool);
    Py_XDECREF(m);
    if (rc < 0)
        Py_CLEAR(S);
    return (PyObject *)S;
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "run(sim, queue, timeouts, counter, wake, deliver): one phase of the replay's event loop "
     "to its end; the events processed."},
    {"pass_seconds", (PyCFunction)(void (*)(void))pass_seconds, METH_FASTCALL,
     "pass_seconds(timing, prefill, context, decodes): TimingModel.pass_seconds in C."},
    {"sender", (PyCFunction)sender, METH_O,
     "sender(sim): Simulation._send's common path (no frontend model, no router queue, "
     "aggregated, KV router) as one callable send(spec, runner, load)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dynamo.replay._loop",
    "The replay's event loop (the fast path of Simulation._phase).", -1, methods,
    NULL, NULL, NULL, NULL,
};

static int
intern(PyObject **slot, const char *text)
{
    return (*slot = PyUnicode_InternFromString(text)) == NULL ? -1 : 0;
}

PyMODINIT_FUNC
PyInit__loop(void)
{
    if (intern(&s_now, "now") || intern(&s_next_ready_at, "next_ready_at") ||
        intern(&s_push, "push") || intern(&s_apply_events, "apply_events") ||
        intern(&s_prefill_completed, "prefill_completed") ||
        intern(&s_request_id, "request_id") || intern(&s_retire, "_retire") ||
        intern(&s_has_work, "has_work") || intern(&s_release_held, "_release_held") ||
        intern(&s_next_when, "next_when") || intern(&s_pop, "pop") ||
        intern(&s_popleft, "popleft") || intern(&s_done, "done") ||
        intern(&s_time_out, "_time_out") || intern(&str_prefill, "prefill") ||
        intern(&s_mock_pass, "mock_pass") || intern(&s_vocab_size, "_vocab_size") ||
        intern(&s_excluded, "_excluded") || intern(&s_timing, "timing") ||
        intern(&s_free, "free") || intern(&s_ended, "ended") ||
        intern(&s_decode_text, "_decode_text") || intern(&str_length, "length") ||
        intern(&s_flights, "flights") || intern(&s_send, "_send") ||
        intern(&s_hashes, "hashes") || intern(&s_route, "route") ||
        intern(&s_worker_id, "worker_id") || intern(&s_dp_rank, "dp_rank") ||
        intern(&s_overlap_blocks, "overlap_blocks") || intern(&s_cost, "cost") ||
        intern(&s_enqueue, "enqueue") || intern(&s_fail, "_fail") || intern(&s_load, "load") ||
        intern(&s_timeout_s, "timeout_s") || intern(&s_append, "append") ||
        intern(&s__running, "_running") || intern(&s__waiting, "_waiting") ||
        intern(&s__requests, "_requests") || intern(&s_kv, "kv") || intern(&s_config, "config") ||
        intern(&s_transfer_seconds, "transfer_seconds") || intern(&s_indexer, "indexer") ||
        intern(&s_apply_in_order, "apply_in_order") || intern(&s_apply_raw, "apply_raw") ||
        intern(&s_sequences, "sequences") || intern(&s__last, "_last") ||
        intern(&s__seed, "_seed") || intern(&s_block_size, "block_size") ||
        capture_originals() < 0)
        return NULL;
    array_type = dyn_import_attr("array", "array");
    if (array_type == NULL || !PyType_Check(array_type))
        return NULL;
    /* the keyword names of the send's two calls (interned: matched by identity) */
    const char *const kw_texts[5] = {"seq_hashes", "max_tokens", "ignore_eos", "handoff",
                                     "hashes"};
    PyObject *kw[5];
    for (int k = 0; k < 5; k++)
        if ((kw[k] = PyUnicode_InternFromString(kw_texts[k])) == NULL)
            return NULL;
    kw_route = PyTuple_Pack(1, kw[0]);
    kw_sequence = PyTuple_Pack(4, kw[1], kw[2], kw[3], kw[4]);
    for (int k = 0; k < 5; k++)
        Py_DECREF(kw[k]);
    if (kw_route == NULL || kw_sequence == NULL || PyType_Ready(&SenderType) < 0)
        return NULL;
    if (dyn_slots_init(&rank_slots) < 0 || dyn_slots_init(&pool_slots) < 0 ||
        dyn_slots_init(&timing_slots) < 0 || dyn_slots_init(&flight_slots) < 0 ||
        dyn_slots_init(&record_slots) < 0 || dyn_slots_init(&seq_slots) < 0 ||
        dyn_slots_init(&spec_slots) < 0)
        return NULL;
    if ((status_ok = PyLong_FromLong(200)) == NULL)
        return NULL;
    for (int k = 0; k < 3; k++)
        if ((state_obj[k] = PyLong_FromLong(k)) == NULL || (kind_obj[k] = PyLong_FromLong(k)) == NULL)
            return NULL;
    if ((one = PyLong_FromLong(1)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "SEND", K_SEND) < 0 ||
        PyModule_AddIntConstant(m, "PASS_END", K_PASS_END) < 0 ||
        PyModule_AddIntConstant(m, "PASS_START", K_PASS_START) < 0 ||
        PyModule_AddIntConstant(m, "IDLE", R_IDLE) < 0 ||
        PyModule_AddIntConstant(m, "SCHEDULED", R_SCHEDULED) < 0 ||
        PyModule_AddIntConstant(m, "BUSY", R_BUSY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

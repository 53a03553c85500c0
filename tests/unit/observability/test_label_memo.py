"""The metric classes of ``metrics.py`` remember ``labels()`` children without changing what
Prometheus sees; ``stage()`` counts and times a block even when it raises."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dynamo.observability.metrics import Counter, FrontendMetrics, Gauge, Histogram


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_labels_returns_the_same_child_by_position_or_keyword() -> None:
    r = CollectorRegistry()
    c = Counter("reqs", "x", ["model", "status"], registry=r)
    child = c.labels("m", "ok")
    assert c.labels("m", "ok") is child
    assert c.labels(model="m", status="ok") is child
    c.labels("m", "ok").inc(2)
    assert _sample(r, "reqs_total", model="m", status="ok") == 2
    with pytest.raises(ValueError):
        c.labels("m")  # still validated (not memoized: it never succeeds)


def test_remove_and_clear_forget_the_remembered_children() -> None:
    r = CollectorRegistry()
    g = Gauge("load", "x", ["worker"], registry=r)
    g.labels("a").set(3)
    g.remove("a")
    assert _sample(r, "load", worker="a") is None
    g.labels("a").set(5)  # a new child, exported again
    assert _sample(r, "load", worker="a") == 5
    g.clear()
    assert _sample(r, "load", worker="a") is None
    g.labels("a").inc()
    assert _sample(r, "load", worker="a") == 1


def test_the_exposition_is_prometheus_clients() -> None:
    import prometheus_client

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    for registry, cls in ((ours, Histogram), (theirs, prometheus_client.Histogram)):
        h = cls("lat", "x", ["model"], registry=registry, buckets=[0.1, 1.0])
        for v in (0.05, 0.5, 5.0):
            h.labels("m").observe(v)

    def strip_created(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines() if "_created" not in line]

    assert strip_created(generate_latest(ours)) == strip_created(generate_latest(theirs))


def test_stage_counts_and_times_even_when_the_block_raises() -> None:
    m = FrontendMetrics("t")
    r = m.registry
    with m.stage("route"):
        assert _sample(r, "t_stage_requests", stage="route", phase="") == 1
    with pytest.raises(RuntimeError), m.stage("route"):
        raise RuntimeError("boom")
    assert _sample(r, "t_stage_requests", stage="route", phase="") == 0
    assert _sample(r, "t_stage_duration_seconds_count", stage="route") == 2


def test_request_meters_tallies_are_what_the_gauges_and_counters_export() -> None:
    m = FrontendMetrics("t")
    r = m.registry
    a = m.meters.request("demo", "chat_completions", "stream", "ns")
    b = m.meters.request("demo", "completions", "unary", "ns")
    assert m.meters.request("demo", "chat_completions", "stream", "ns") is a
    assert a.active is b.active and a.queued is b.queued  # one level per model
    a.active.n += 2
    b.queued.n += 1
    for name in ("t_active_requests", "t_inflight_requests"):
        assert _sample(r, name, model="demo") == 2
    assert _sample(r, "t_queued_requests", model="demo") == 1
    a.active.n -= 2
    assert _sample(r, "t_active_requests", model="demo") == 0
    a.succeeded.n += 1
    labels = dict(model="demo", endpoint="chat_completions", request_type="stream")
    assert _sample(r, "t_requests_total", status="success", error_type="", **labels) == 1
    with m.meters.stage("dispatch", "decode").timer():
        assert _sample(r, "t_stage_requests", stage="dispatch", phase="decode") == 1
    assert _sample(r, "t_stage_requests", stage="dispatch", phase="decode") == 0


def test_tallied_children_export_what_prometheus_clients_do() -> None:
    import prometheus_client

    from dynamo.observability.meters import HistogramTally, Tally

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    for registry, tallied in ((ours, True), (theirs, False)):
        c = prometheus_client.Counter("c", "x", ["m"], registry=registry)
        g = prometheus_client.Gauge("g", "x", ["m"], registry=registry)
        h = prometheus_client.Histogram("h", "x", ["m"], registry=registry, buckets=[0.1, 1, 2.5])
        c.labels("a").inc(2)  # before the tally: carried over
        h.labels("a").observe(0.5)
        values = [-1.0, 0.0, 0.1, 0.5, 1.0, 2.5, 3.0, float("inf"), float("nan")]
        if tallied:
            counter = Tally.of(c.labels("a"))
            assert Tally.of(c.labels("a")) is counter  # one tally per child
            counter.n += 1
            gauge = Tally.of(g.labels("a"), g.labels("b"))  # two gauges moving together
            gauge.n += 3
            gauge.n -= 1
            hist = HistogramTally.of(h.labels("a"))
            assert HistogramTally.of(h.labels("a")) is hist
            for v in values:  # below, on and between the bounds, beyond them, NaN (no bucket)
                hist.observe(v)
        else:
            c.labels("a").inc()
            g.labels("a").inc(2)
            g.labels("b").inc(2)
            for v in values:
                h.labels("a").observe(v)
        c.labels("a").inc(0.5)  # the library's own calls still work on a tallied child
        h.labels("a").observe(0.05)

    def strip_created(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines() if "_created" not in line]

    assert strip_created(generate_latest(ours)) == strip_created(generate_latest(theirs))

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


def test_request_meters_levels_are_what_the_in_flight_gauges_export() -> None:
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
    a.succeeded.inc()
    labels = dict(model="demo", endpoint="chat_completions", request_type="stream")
    assert _sample(r, "t_requests_total", status="success", error_type="", **labels) == 1
    with m.meters.stage("dispatch", "decode").timer():
        assert _sample(r, "t_stage_requests", stage="dispatch", phase="decode") == 1
    assert _sample(r, "t_stage_requests", stage="dispatch", phase="decode") == 0

"""observe_many gives the same histogram as observing each value."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from dynamo.observability.buckets import log_buckets
from dynamo.observability.metrics import observe_many


def test_same_exposition_as_observe() -> None:
    values = [0.0, 0.0019, 0.002, 0.05, 0.3, 1.9, 2.0, 5.0, 0.0005]
    a, b = CollectorRegistry(), CollectorRegistry()
    buckets = log_buckets(0.001, 2, 13)
    ha = Histogram("itl", "x", ["model"], registry=a, buckets=buckets)
    hb = Histogram("itl", "x", ["model"], registry=b, buckets=buckets)
    for v in values:
        ha.labels("m").observe(v)
    observe_many(hb.labels("m"), values)
    observe_many(hb.labels("m"), [])

    def strip_created(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines() if "_created" not in line]

    assert strip_created(generate_latest(a)) == strip_created(generate_latest(b))

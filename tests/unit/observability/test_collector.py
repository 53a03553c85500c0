"""``ScrapeCollector``: registered on construction, read only when scraped, from live state."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from dynamo.observability.collector import ScrapeCollector, counter, gauge


class Depth(ScrapeCollector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.depth: int | None = None  # no state yet when registered
        self.scrapes = 0
        super().__init__(registry)

    def collect(self) -> Iterator[Metric]:
        self.scrapes += 1
        assert self.depth is not None
        yield gauge("queue_depth", "Held requests", ["queue"], ["a"], self.depth)
        yield counter("queue_refused", "Refused requests", ["queue"], ["a"], 2 * self.depth)


def test_registering_does_not_collect_and_a_scrape_reads_live_state() -> None:
    registry = CollectorRegistry()
    depth = Depth(registry)
    assert depth.scrapes == 0
    depth.depth = 3
    text = generate_latest(registry).decode()
    assert 'queue_depth{queue="a"} 3.0' in text
    assert 'queue_refused_total{queue="a"} 6.0' in text
    depth.depth = 5
    assert 'queue_depth{queue="a"} 5.0' in generate_latest(registry).decode()
    assert depth.scrapes == 2

"""``ScrapeCollector``: the one way to expose state that is read at every scrape.

The frontend's worker loads and router queues, the worker's per-rank engine gauges and the
PyTorch engine's step counters are not pushed into ``prometheus_client`` metrics as they change:
their owner already keeps them, so a collector builds the metric families from that state when
``/metrics`` is scraped (never stale, nothing to keep in step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class ScrapeCollector(ABC):
    """Registers itself on ``registry``; :meth:`collect` yields the families from live state.

    :meth:`describe` returns nothing, so registering never calls :meth:`collect` (the state may
    not exist yet) and the registry's name-clash check does not see these families: each family
    name must come from one collector only. ``collect`` runs on the scraping thread or event
    loop: it must be cheap and must not raise. Subclasses set their fields before calling
    ``super().__init__``.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        registry.register(self)

    def describe(self) -> list[Metric]:
        return []

    @abstractmethod
    def collect(self) -> Iterator[Metric]: ...


def gauge(
    name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float
) -> GaugeMetricFamily:
    """A gauge family of one sample."""
    family = GaugeMetricFamily(name, doc, labels=labels)
    family.add_metric(values, value)
    return family


def counter(
    name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float
) -> CounterMetricFamily:
    """A counter family of one sample (``name`` without ``_total``: the exposition adds it)."""
    family = CounterMetricFamily(name, doc, labels=labels)
    family.add_metric(values, value)
    return family

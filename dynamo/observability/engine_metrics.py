"""Engine-side metrics of a worker: per-rank engine gauges collected from the engines at every
scrape, and the windowed prefix-cache hit rate the engines report (FACTS §10.1 names)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dynamo.backend.engine import RankMetrics
from dynamo.observability.collector import ScrapeCollector

# Engine gauges (the reference's ``prometheus_names.kvstats`` under ``dynamo_component_``; the
# reference's worker takes running/waiting from its engine as vLLM's ``num_requests_*``).
ENGINE_GAUGES = (
    ("dynamo_component_total_blocks", "Total number of KV cache blocks available on the worker"),
    ("dynamo_component_gpu_cache_usage_percent", "KV cache usage as a fraction (0.0-1.0)"),
    ("dynamo_component_kv_cache_hit_rate", "Prefix cache hit rate (0.0-1.0)"),
    ("dynamo_component_num_requests_running", "Requests running in the engine"),
    ("dynamo_component_num_requests_waiting", "Requests waiting for admission in the engine"),
)
# Disaggregation (per role: a prefill worker's handoffs are remote prefills it ran, a decode
# worker's are the prompts it received; transfers are counted where the KV lands).
DISAGG_COUNTERS = (
    ("dynamo_component_disagg_handoffs", "Remote prefills handed off (prefill) or received"),
    ("dynamo_component_kv_transfer_bytes", "KV bytes received from prefill workers"),
    ("dynamo_component_kv_transfer_seconds", "Seconds spent receiving KV from prefill workers"),
)
ENGINE_LABELS = (
    "model",
    "dynamo_namespace",
    "dynamo_component",
    "dynamo_endpoint",
    "worker_id",
    "dp_rank",
)

EngineSnapshots = Callable[[], Iterable[tuple[str, int, Sequence[RankMetrics]]]]
"""Yields (model, worker id, that engine's ``metrics_snapshot()``) for each engine."""


class EngineGauges(ScrapeCollector):
    """Per-rank engine gauges, collected from the engines at every scrape. Registered on a
    worker's registry; ``source`` must be cheap and must not raise."""

    def __init__(
        self,
        registry: CollectorRegistry,
        namespace: str,
        component: str,
        endpoint: str,
        source: EngineSnapshots,
    ) -> None:
        self._static = (namespace, component, endpoint)
        self._source = source
        super().__init__(registry)

    def collect(self) -> Iterator[Metric]:
        families = [GaugeMetricFamily(n, doc, labels=ENGINE_LABELS) for n, doc in ENGINE_GAUGES]
        total, usage, hit_rate, running, waiting = families
        handoffs, moved, moving = (
            CounterMetricFamily(n, doc, labels=ENGINE_LABELS) for n, doc in DISAGG_COUNTERS
        )
        for model, worker_id, ranks in self._source():
            for m in ranks:
                labels = [model, *self._static, str(worker_id), str(m.dp_rank)]
                total.add_metric(labels, m.kv_total_blocks)
                usage.add_metric(labels, m.kv_usage)
                if m.prefix_cache_hit_rate is not None:
                    hit_rate.add_metric(labels, m.prefix_cache_hit_rate)
                running.add_metric(labels, m.num_running)
                waiting.add_metric(labels, m.num_waiting)
                if m.disagg is not None:
                    handoffs.add_metric(labels, m.disagg.handoffs)
                    moved.add_metric(labels, m.disagg.transfer_bytes)
                    moving.add_metric(labels, m.disagg.transfer_seconds)
        yield from families
        for family in (handoffs, moved, moving):
            if family.samples:
                yield family


class HitRateWindow:
    """Prefix-cache hit rate over the last ``size`` requests (vLLM's windowed definition):
    cached prompt tokens / prompt tokens. ``rate`` is None until a request was observed."""

    __slots__ = ("_window", "_queried", "_hit")

    def __init__(self, size: int = 1000) -> None:
        self._window: deque[tuple[int, int]] = deque(maxlen=size)
        self._queried = 0
        self._hit = 0

    def observe(self, prompt_tokens: int, cached_tokens: int) -> None:
        window = self._window
        if len(window) == window.maxlen:
            old_queried, old_hit = window[0]
            self._queried -= old_queried
            self._hit -= old_hit
        window.append((prompt_tokens, cached_tokens))
        self._queried += prompt_tokens
        self._hit += cached_tokens

    @property
    def rate(self) -> float | None:
        if not self._window:
            return None
        return self._hit / self._queried if self._queried else 0.0

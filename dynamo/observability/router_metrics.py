"""The KV router's request and queue metrics on the process that hosts it (the frontend).

* :class:`RouterRequestMetrics`: the reference's component-scoped ``dynamo_component_router_*``
  families (FACTS §10.1; names from the reference's ``prometheus_names.router``): requests
  started (admitted by the router's scheduler: routed) and ended, TTFT, average ITL, input and
  output tokens, and the predicted KV hit rate, labelled with the routed workers'
  ``dynamo_namespace`` / ``dynamo_component`` / ``dynamo_endpoint`` and the frontend's
  ``router_id``. Created at the frontend's start, so they read 0 before any request.
* :class:`RouterQueueGauges`: ``{prefix}_router_queue_pending_requests{worker_type,
  policy_class}`` (and the held requests' prompt and predicted cached tokens, and the queue-limit
  refusals), read from the routers' queues at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dynamo.observability.buckets import log_buckets
from dynamo.observability.metrics import Counter, Histogram

COMPONENT_LABELS = ["dynamo_namespace", "dynamo_component", "dynamo_endpoint", "router_id"]
HIT_RATE_BUCKETS = [round(0.05 * i, 2) for i in range(21)]


class RouterRequestMetrics:
    """The ``dynamo_component_router_*`` families of one process (one registry)."""

    def __init__(self, registry: CollectorRegistry, router_id: int) -> None:
        r = registry
        names = COMPONENT_LABELS
        self.router_id = str(router_id)
        self.started = Counter(
            "dynamo_component_router_requests_started",
            "Requests admitted by the router scheduler",
            names,
            registry=r,
        )
        self.requests = Counter(
            "dynamo_component_router_requests",
            "Requests processed by the router",
            names,
            registry=r,
        )
        self.ttft = Histogram(
            "dynamo_component_router_time_to_first_token_seconds",
            "Time to first token observed at the router",
            names,
            registry=r,
            buckets=log_buckets(0.001, 480.0, 18),
        )
        self.itl = Histogram(
            "dynamo_component_router_inter_token_latency_seconds",
            "Average inter-token latency observed at the router",
            names,
            registry=r,
            buckets=log_buckets(0.001, 2.0, 13),
        )
        self.input_tokens = Histogram(
            "dynamo_component_router_input_sequence_tokens",
            "Input sequence length in tokens observed at the router",
            names,
            registry=r,
            buckets=log_buckets(50.0, 128000.0, 12),
        )
        self.output_tokens = Histogram(
            "dynamo_component_router_output_sequence_tokens",
            "Output sequence length in tokens observed at the router",
            names,
            registry=r,
            buckets=log_buckets(50.0, 32000.0, 10),
        )
        self.kv_hit_rate = Histogram(
            "dynamo_component_router_kv_hit_rate",
            "Predicted KV cache hit rate at routing time (0.0-1.0)",
            names,
            registry=r,
            buckets=HIT_RATE_BUCKETS,
        )

    def bind(self, namespace: str, component: str, endpoint: str) -> RouterRequestSeries:
        """The series of one router (the workers it routes to), created now so they read 0."""
        values = (namespace, component, endpoint, self.router_id)
        return RouterRequestSeries(
            self.started.labels(*values),
            self.requests.labels(*values),
            self.ttft.labels(*values),
            self.itl.labels(*values),
            self.input_tokens.labels(*values),
            self.output_tokens.labels(*values),
            self.kv_hit_rate.labels(*values),
        )


@dataclass(frozen=True, slots=True)
class RouterRequestSeries:
    """One router's children of :class:`RouterRequestMetrics` (prometheus_client children)."""

    started: Any
    requests: Any
    ttft: Any
    itl: Any
    input_tokens: Any
    output_tokens: Any
    kv_hit_rate: Any

    def routed(self, isl: int, hit_rate: float) -> None:
        """A request was admitted and placed (each attempt of a migrated request counts)."""
        self.started.inc()
        self.input_tokens.observe(isl)
        self.kv_hit_rate.observe(hit_rate)

    def ended(self, ttft_s: float | None, avg_itl_s: float | None, output_tokens: int) -> None:
        """A request ended: its TTFT from the router's first look at it (queue wait included),
        its average inter-token latency (None: fewer than two tokens) and its output tokens."""
        self.requests.inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if avg_itl_s is not None:
            self.itl.observe(avg_itl_s)
        self.output_tokens.observe(output_tokens)


QueueDepths = Callable[[], Iterable[tuple[str, str, int, int, int, int]]]
"""Yields (worker type, policy class, held requests, their prompt tokens, their predicted cached
tokens, requests refused by the queue limit since start), one per router queue."""


class RouterQueueGauges:
    """The frontend's router-queue families, summed over its models' routers of each worker
    type, read at every scrape (the queues themselves are the only state)."""

    def __init__(self, prefix: str, registry: CollectorRegistry, source: QueueDepths) -> None:
        self._prefix = prefix.rstrip("_")
        self._source = source
        registry.register(self)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p = self._prefix
        labels = ["worker_type", "policy_class"]
        pending = GaugeMetricFamily(
            f"{p}_router_queue_pending_requests",
            "Requests pending in the router scheduler queue",
            labels=labels,
        )
        isl = GaugeMetricFamily(
            f"{p}_router_queue_pending_isl_tokens",
            "Prompt tokens of the requests pending in the router scheduler queue",
            labels=labels,
        )
        cached = GaugeMetricFamily(
            f"{p}_router_queue_pending_cached_tokens",
            "Predicted cached tokens of the requests pending in the router scheduler queue",
            labels=labels,
        )
        refused = CounterMetricFamily(
            f"{p}_router_queue_backpressure",
            "Requests refused by the router scheduler queue",
            labels=[*labels, "reason"],
        )
        sums: dict[tuple[str, str], list[int]] = {}
        for worker_type, policy_class, n, isl_tokens, cached_tokens, rejected in self._source():
            acc = sums.setdefault((worker_type, policy_class), [0, 0, 0, 0])
            acc[0] += n
            acc[1] += isl_tokens
            acc[2] += cached_tokens
            acc[3] += rejected
        for (worker_type, policy_class), (n, isl_tokens, cached_tokens, rejected) in sums.items():
            key = [worker_type, policy_class]
            pending.add_metric(key, n)
            isl.add_metric(key, isl_tokens)
            cached.add_metric(key, cached_tokens)
            refused.add_metric([*key, "request_limit"], rejected)
        yield pending
        yield isl
        yield cached
        yield refused

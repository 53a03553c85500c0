"""The KV router's request and queue metrics on the process that hosts it (the frontend).

* :class:`RouterRequestMetrics`: the reference's component-scoped ``dynamo_component_router_*``
  families (FACTS §10.1; names from the reference's ``prometheus_names.router``): requests
  started (admitted by the router's scheduler: routed) and ended, TTFT, average ITL, input and
  output tokens, the predicted KV hit rate, cached prefix tokens of the selected and of the
  best eligible rank, selections with less than the most overlap and the blocks they give up,
  the tokens workers report reused, the registered worker ranks, the KV transfer latency bound
  of disaggregated requests and the workers whose KV events the router cannot check (the
  reference's ``kv_transfer_estimated_latency_seconds`` and
  ``router_kv_event_source_mismatch_workers``); labelled with the routed workers'
  ``dynamo_namespace`` / ``dynamo_component`` / ``dynamo_endpoint`` and the frontend's
  ``router_id``. Created with each router, so they read 0 before any request.
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
from dynamo.observability.collector import ScrapeCollector
from dynamo.observability.metrics import Counter, Gauge, Histogram

COMPONENT_LABELS = ["dynamo_namespace", "dynamo_component", "dynamo_endpoint", "router_id"]
HIT_RATE_BUCKETS = [round(0.05 * i, 2) for i in range(21)]
SOURCE_LABELS = ["model", "worker_type", "target_namespace", "target_component", "target_endpoint"]
"""The reference's own labels of ``router_kv_event_source_mismatch_workers`` (1.6.1)."""


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
        self.best_cached = Counter(
            "dynamo_component_router_kv_best_eligible_cached_prefix_tokens",
            "Cached prefix tokens on the best eligible worker rank, per routing decision",
            names,
            registry=r,
        )
        self.selected_cached = Counter(
            "dynamo_component_router_kv_selected_cached_prefix_tokens",
            "Cached prefix tokens on the selected worker rank, per routing decision",
            names,
            registry=r,
        )
        self.reused = Counter(
            "dynamo_component_router_kv_worker_reused_tokens",
            "Prompt tokens the workers reported as served from their KV cache",
            names,
            registry=r,
        )
        self.non_max_overlap = Counter(
            "dynamo_component_router_non_max_overlap_selections",
            "Selections with less prefix overlap than another eligible worker rank",
            [*names, "worker_type"],
            registry=r,
        )
        self.overlap_lost = Histogram(
            "dynamo_component_router_overlap_blocks_lost",
            "Overlap blocks given up by a selection with less overlap than the best eligible",
            [*names, "worker_type"],
            registry=r,
            buckets=[float(2**i) for i in range(12)],
        )
        self.registered = Gauge(
            "dynamo_component_router_worker_registered",
            "Whether the router has this worker rank registered (1 = registered)",
            [*names, "router_worker_id", "dp_rank", "worker_type"],
            registry=r,
        )
        # The reference's name, help and buckets: measured, not computed from sizes (the
        # reference's RequestTracker: decode first token - prefill result at the router).
        self.kv_transfer = Histogram(
            "dynamo_component_router_kv_transfer_estimated_latency_seconds",
            "Upper-bound estimation of KV cache transfer latency in disaggregated serving "
            "(prefill_complete to first_token)",
            names,
            registry=r,
            buckets=log_buckets(0.001, 10.0, 15),
        )
        self.source_mismatch = Gauge(
            "dynamo_component_router_kv_event_source_mismatch_workers",
            "Workers the router expects KV events from that explicitly disabled KV event "
            "publishing or have no registered KV query endpoint (kv_recovery)",
            [*names, *SOURCE_LABELS],
            registry=r,
        )

    def bind(
        self, namespace: str, component: str, endpoint: str, worker_type: str, model: str
    ) -> RouterRequestSeries:
        """The series of one router (the workers of ``model`` it routes to, of
        ``worker_type``), created now so they read 0."""
        values = (namespace, component, endpoint, self.router_id)
        target = (model, worker_type, namespace, component, endpoint)
        return RouterRequestSeries(
            self.started.labels(*values),
            self.requests.labels(*values),
            self.ttft.labels(*values),
            self.itl.labels(*values),
            self.input_tokens.labels(*values),
            self.output_tokens.labels(*values),
            self.kv_hit_rate.labels(*values),
            self.best_cached.labels(*values),
            self.selected_cached.labels(*values),
            self.reused.labels(*values),
            self.non_max_overlap.labels(*values, worker_type),
            self.overlap_lost.labels(*values, worker_type),
            self.kv_transfer.labels(*values),
            self.source_mismatch.labels(*values, *target),
            self.registered,
            (*values, worker_type),
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
    best_cached: Any
    selected_cached: Any
    reused: Any
    non_max_overlap: Any
    overlap_lost: Any
    kv_transfer: Any
    source_mismatch: Any
    registered_family: Gauge
    labels: tuple[str, ...]  # the component labels, router_id and worker_type

    def routed(
        self, isl: int, overlap_blocks: int, block_size: int, among: list[int] | None
    ) -> None:
        """A request was admitted and placed (each attempt of a migrated request counts):
        its prompt, the chosen rank's overlap blocks and those of the ranks it was chosen
        among (None: pinned, no choice). Counts the cached prefix tokens of the chosen and of
        the best eligible rank, and a selection with less than the most overlap."""
        best = max(among, default=overlap_blocks) if among is not None else overlap_blocks
        cached = min(overlap_blocks * block_size, isl)
        self.started.inc()
        self.input_tokens.observe(isl)
        self.kv_hit_rate.observe(cached / isl if isl else 0.0)
        self.selected_cached.inc(cached)
        self.best_cached.inc(min(best * block_size, isl))
        if best > overlap_blocks:
            self.non_max_overlap.inc()
            self.overlap_lost.observe(best - overlap_blocks)

    def ended(
        self,
        ttft_s: float | None,
        avg_itl_s: float | None,
        output_tokens: int,
        reused_tokens: int | None,
        kv_transfer_s: float | None = None,
    ) -> None:
        """A request ended: its TTFT from the router's first look at it (queue wait included),
        its average inter-token latency (None: fewer than two tokens), its output tokens, the
        prompt tokens its worker served from cache (None: not reported) and, for a request
        prefilled remotely, the bound on its KV transfer (:func:`kv_transfer_bound`; None:
        prefilled locally, or no first token)."""
        self.requests.inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if avg_itl_s is not None:
            self.itl.observe(avg_itl_s)
        if kv_transfer_s is not None:
            self.kv_transfer.observe(kv_transfer_s)
        self.output_tokens.observe(output_tokens)
        if reused_tokens:
            self.reused.inc(reused_tokens)

    def worker_registered(self, worker_id: int, dp_rank: int, registered: bool) -> None:
        """``router_worker_registered``: set when a rank joins, removed when it leaves."""
        namespace, component, endpoint, router_id, worker_type = self.labels
        values = (namespace, component, endpoint, router_id, str(worker_id), str(dp_rank))
        if registered:
            self.registered_family.labels(*values, worker_type).set(1)
            return
        try:
            self.registered_family.remove(*values, worker_type)
        except KeyError:
            pass

    def event_source_mismatches(self, workers: int) -> None:
        """``router_kv_event_source_mismatch_workers``: how many of this router's workers it
        expects KV events from have no KV query endpoint (``router/event_sources.py``)."""
        self.source_mismatch.set(workers)


def kv_transfer_bound(prefill_done_at: float | None, first_token_at: float | None) -> float | None:
    """The reference's upper bound on one disaggregated request's KV transfer (seconds): from
    the moment the frontend received the prefill worker's handoff to the decode worker's first
    token. It assumes the transfer starts no earlier than the handoff's arrival and is done by
    the first token, so it also holds the decode dispatch (request plane both ways), the decode
    worker's queueing and its first forward pass: an upper bound, never less than the transfer
    (ours pulls the KV when the decode request arrives). None when either moment never came;
    never negative (a clock read out of order)."""
    if prefill_done_at is None or first_token_at is None:
        return None
    return max(0.0, first_token_at - prefill_done_at)


QueueDepths = Callable[[], Iterable[tuple[str, str, int, int, int, int]]]
"""Yields (worker type, policy class, held requests, their prompt tokens, their predicted cached
tokens, requests refused by the queue limit since start), one per router queue."""


class RouterQueueGauges(ScrapeCollector):
    """The frontend's router-queue families, summed over its models' routers of each worker
    type, read at every scrape (the queues themselves are the only state)."""

    def __init__(self, prefix: str, registry: CollectorRegistry, source: QueueDepths) -> None:
        self._prefix = prefix.rstrip("_")
        self._source = source
        super().__init__(registry)

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

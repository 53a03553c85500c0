"""Every Prometheus metric of dynamo-py, declared once, with the reference names (FACTS §10.1).

Each service builds its metrics on its own ``CollectorRegistry`` (several services may share a
process in tests and in ``dynamo serve --in-process``).
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase

from dynamo.observability.buckets import env_buckets, exponential_buckets
from dynamo.observability.collector import ScrapeCollector
from dynamo.observability.meters import Meters, StageTimer


class _LabelMemo(MetricWrapperBase):
    """``labels(*values)`` remembered per values tuple. prometheus_client's own ``labels()``
    converts every value to ``str``, builds a tuple and takes a lock: about 10 µs on the 2-core
    VM, and a request calls it ~30 times (its counters, gauges and histograms). The child is
    the same object either way; ``remove``/``clear`` forget the memo with the child."""

    _memo: dict[tuple[object, ...], Any]

    def labels(self: _M, *labelvalues: object, **labelkwargs: object) -> _M:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)
        memo = self.__dict__.get("_memo")
        if memo is None:
            memo = self._memo = {}
        else:
            child = memo.get(labelvalues)
            if child is not None:
                return child  # type: ignore[no-any-return]
        child = super().labels(*labelvalues)
        memo[labelvalues] = child
        return child

    def remove(self, *labelvalues: object) -> None:
        self.__dict__.pop("_memo", None)
        super().remove(*labelvalues)

    def clear(self) -> None:
        self.__dict__.pop("_memo", None)
        super().clear()


_M = TypeVar("_M", bound=_LabelMemo)


class Counter(_LabelMemo, prometheus_client.Counter):
    """prometheus_client's Counter with memoized ``labels()``."""


class Gauge(_LabelMemo, prometheus_client.Gauge):
    """prometheus_client's Gauge with memoized ``labels()``."""


class Histogram(_LabelMemo, prometheus_client.Histogram):
    """prometheus_client's Histogram with memoized ``labels()``."""


def frontend_prefix() -> str:
    return os.environ.get("DYN_METRICS_PREFIX", "dynamo_frontend")


class FrontendMetrics:
    """The frontend's metric families (prefix ``dynamo_frontend_`` unless overridden)."""

    def __init__(
        self, prefix: str | None = None, registry: CollectorRegistry | None = None
    ) -> None:
        p = (prefix or frontend_prefix()).rstrip("_")
        self.prefix = p
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{p}_requests",
            "Requests by model, endpoint, type, status and error type",
            ["model", "endpoint", "request_type", "status", "error_type"],
            registry=r,
        )
        self.active_requests = Gauge(
            f"{p}_active_requests", "Requests in flight", ["model"], registry=r
        )
        self.inflight_requests = Gauge(
            f"{p}_inflight_requests", "Requests in flight (deprecated name)", ["model"], registry=r
        )
        self.disconnected_clients = Gauge(
            f"{p}_disconnected_clients", "Clients that disconnected mid-request", registry=r
        )
        self.request_duration = Histogram(
            f"{p}_request_duration_seconds",
            "Request duration",
            ["model"],
            registry=r,
            buckets=env_buckets("REQUEST_DURATION", 1, 512, 10),
        )
        self.input_tokens = Histogram(
            f"{p}_input_sequence_tokens",
            "Prompt length",
            ["model", "dynamo_namespace"],
            registry=r,
            buckets=env_buckets("INPUT_SEQUENCE", 50, 128000, 12),
        )
        self.output_tokens = Histogram(
            f"{p}_output_sequence_tokens",
            "Completion length",
            ["model"],
            registry=r,
            buckets=env_buckets("OUTPUT_SEQUENCE", 50, 32000, 10),
        )
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            registry=r,
            buckets=env_buckets("TTFT", 0.001, 480, 18),
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds",
            "Inter-token latency",
            ["model"],
            registry=r,
            buckets=env_buckets("ITL", 0.001, 2, 13),
        )
        self.output_tokens_total = Counter(
            f"{p}_output_tokens", "Generated tokens", ["model", "dynamo_namespace"], registry=r
        )
        self.cached_tokens = Histogram(
            f"{p}_cached_tokens",
            "Prompt tokens served from the KV cache",
            ["model"],
            registry=r,
            buckets=env_buckets("INPUT_SEQUENCE", 50, 128000, 12),
        )
        card_labels = ["model", "dynamo_namespace", "worker_type"]
        self.model_total_kv_blocks = Gauge(
            f"{p}_model_total_kv_blocks", "KV blocks", card_labels, registry=r
        )
        self.model_max_num_seqs = Gauge(
            f"{p}_model_max_num_seqs", "Max sequences", card_labels, registry=r
        )
        self.model_max_num_batched_tokens = Gauge(
            f"{p}_model_max_num_batched_tokens", "Max batched tokens", card_labels, registry=r
        )
        self.model_context_length = Gauge(
            f"{p}_model_context_length", "Context length", card_labels, registry=r
        )
        self.model_kv_cache_block_size = Gauge(
            f"{p}_model_kv_cache_block_size", "KV block size", card_labels, registry=r
        )
        self.model_ready = Gauge(
            f"{p}_model_ready", "1 if the model has live instances", ["model"], registry=r
        )
        self.model_cancellation = Counter(
            f"{p}_model_cancellation",
            "Cancelled requests",
            ["model", "endpoint", "request_type"],
            registry=r,
        )
        self.model_rejection = Counter(
            f"{p}_model_rejection",
            "Requests rejected for overload",
            ["model", "endpoint"],
            registry=r,
        )
        # -- issue 17: the FACTS §10.1 families that were missing --------------------------
        self.requests_started = Counter(
            f"{p}_requests_started",
            "Requests admitted to generation (each once)",
            ["model", "endpoint", "request_type"],
            registry=r,
        )
        self.failures = Counter(
            f"{p}_failures",
            "Requests that ended in an error (each once)",
            ["model", "endpoint", "request_type", "error_type"],
            registry=r,
        )
        self.queued_requests = Gauge(
            f"{p}_queued_requests",
            "Requests admitted and waiting for their first response (deprecated name)",
            ["model"],
            registry=r,
        )
        self.stage_requests = Gauge(
            f"{p}_stage_requests",
            "Requests in a pipeline stage (preprocess, route, dispatch)",
            ["stage", "phase"],
            registry=r,
        )
        self.stage_duration = Histogram(
            f"{p}_stage_duration_seconds",
            "Time spent in a pipeline stage (dispatch: sent until the first response)",
            ["stage"],
            registry=r,
            buckets=env_buckets("TTFT", 0.001, 480, 18),
        )
        self.tokenizer_latency = Histogram(
            f"{p}_tokenizer_latency_ms",
            "Preprocessing (template + tokenization) time per request, milliseconds",
            ["model"],
            registry=r,
            buckets=[0, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 1000],
        )
        self.kv_hit_rate = Histogram(
            f"{p}_kv_hit_rate",
            "Prompt tokens served from the KV cache, as a fraction of the prompt",
            ["model"],
            registry=r,
            buckets=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
        )
        worker_labels = ["worker_id", "dp_rank", "worker_type"]
        self.worker_last_ttft = Gauge(
            f"{p}_worker_last_time_to_first_token_seconds",
            "TTFT of the latest request a worker served",
            worker_labels,
            registry=r,
        )
        self.worker_last_isl = Gauge(
            f"{p}_worker_last_input_sequence_tokens",
            "Prompt length of the latest request a worker served",
            worker_labels,
            registry=r,
        )
        self.worker_last_itl = Gauge(
            f"{p}_worker_last_inter_token_latency_seconds",
            "Mean inter-token latency of the latest request a worker served",
            worker_labels,
            registry=r,
        )
        # Request migration (FACTS §7): a retry on another instance after a migratable failure.
        self.model_migration = Counter(
            f"{p}_model_migration",
            "Request migrations (new_request: failed before any response; ongoing_request: "
            "failed mid-stream)",
            ["model", "migration_type"],
            registry=r,
        )
        self.model_migration_duration = Histogram(
            f"{p}_model_migration_duration_seconds",
            "From a request's first migration to its end",
            ["outcome"],
            registry=r,
        )
        self.model_migration_max_seq_len_exceeded = Counter(
            f"{p}_model_migration_max_seq_len_exceeded",
            "Requests no longer migratable: prompt + generated > DYN_MIGRATION_MAX_SEQ_LEN",
            ["model"],
            registry=r,
        )
        self.model_migration_limit = Gauge(
            f"{p}_model_migration_limit",
            "Migrations allowed per request",
            ["model", "dynamo_namespace", "worker_type"],
            registry=r,
        )
        # Disaggregation (frontend/disagg.py)
        self.disagg_prefills = Counter(
            f"{p}_disagg_prefills",
            "Prefills of disaggregated models by where they ran (placement remote or local)",
            ["model", "placement"],
            registry=r,
        )
        self.disagg_queue_depth = Gauge(
            f"{p}_disagg_prefill_queue_depth",
            "Remote prefills waiting for a prefill worker",
            ["model"],
            registry=r,
        )
        self.disagg_remote_inflight = Gauge(
            f"{p}_disagg_remote_prefills_inflight",
            "Remote prefills dispatched and not finished",
            ["model"],
            registry=r,
        )
        # The children a request records into, resolved once per label set (meters.py).
        self.meters = Meters(self)

    def stage(self, stage: str, phase: str = "") -> StageTimer:
        """``with``: count a request in ``stage`` (``stage_requests``) and time it
        (``stage_duration``)."""
        return self.meters.stage(stage, phase).timer()


WorkerLoads = Callable[[], Iterable[tuple[int, int, str, int, int]]]
"""Yields (worker id, dp rank, worker type, active decode blocks, active prefill tokens)."""


class WorkerLoadGauges(ScrapeCollector):
    """The frontend's ``worker_active_decode_blocks`` / ``worker_active_prefill_tokens``: the
    KV routers' view of each worker's load, read at every scrape."""

    def __init__(self, prefix: str, registry: CollectorRegistry, source: WorkerLoads) -> None:
        self._prefix = prefix.rstrip("_")
        self._source = source
        super().__init__(registry)

    def collect(self) -> Iterator[Metric]:
        labels = ["worker_id", "dp_rank", "worker_type"]
        p = self._prefix
        blocks = GaugeMetricFamily(
            f"{p}_worker_active_decode_blocks", "Decode blocks the router counts", labels=labels
        )
        tokens = GaugeMetricFamily(
            f"{p}_worker_active_prefill_tokens", "Prefill tokens the router counts", labels=labels
        )
        for worker_id, dp_rank, worker_type, decode_blocks, prefill_tokens in self._source():
            key = [f"{worker_id:x}", str(dp_rank), worker_type]
            blocks.add_metric(key, decode_blocks)
            tokens.add_metric(key, prefill_tokens)
        yield blocks
        yield tokens


# The reference's router overhead buckets (ms): CPU-bound phases (hashing) and phases that may
# wait (find_matches, scheduling, total).
COMPUTE_OVERHEAD_BUCKETS_MS = exponential_buckets(0.001, 2.0, 15)
ASYNC_OVERHEAD_BUCKETS_MS = exponential_buckets(0.01, 3.0, 17)
ROUTER_PHASES = ("block_hashing", "seq_hashing", "indexer_find_matches", "scheduling", "total")


class RouterMetrics:
    """KV router metrics (FACTS §10.1 names: dynamo_router_*, kv_cache_events_applied).

    ``dynamo_router_overhead_{phase}_ms`` are the reference's per-request routing phase
    histograms, with its constant ``router_id`` label (this frontend's router id)."""

    def __init__(self, registry: CollectorRegistry, router_id: int = 0) -> None:
        r = registry
        self.router_id = router_id
        self.overhead_ms = {
            phase: Histogram(
                f"dynamo_router_overhead_{phase}_ms",
                f"Routing overhead per request in milliseconds: {phase.replace('_', ' ')}",
                registry=r,
                buckets=COMPUTE_OVERHEAD_BUCKETS_MS
                if phase.endswith("hashing")
                else ASYNC_OVERHEAD_BUCKETS_MS,
                labelnames=["router_id"],
            ).labels(str(router_id))
            for phase in ROUTER_PHASES
        }
        self.kv_hit_rate = Histogram(
            "dynamo_router_kv_hit_rate",
            "Predicted KV overlap of the chosen worker (fraction of prompt)",
            ["model"],
            registry=r,
            buckets=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
        )
        self.events_applied = Counter(
            "dynamo_component_kv_cache_events_applied",
            "KV events applied by the router's index",
            ["status", "event_type"],
            registry=r,
        )
        self.replica_sync_dropped = Counter(
            "dynamo_router_replica_sync_dropped",
            "Replica-sync events dropped (queue full)",
            registry=r,
        )
        # The cache-consistency check (router/consistency.py).
        self.kv_index_drift = Gauge(
            "dynamo_router_kv_index_drift_blocks",
            "Blocks by which the router's view of a worker rank differs from the worker's own "
            "(at least 1 when the counts agree but the digests do not); 0 when consistent",
            ["model", "worker_id", "dp_rank"],
            registry=r,
        )
        self.kv_index_resyncs = Counter(
            "dynamo_router_kv_index_resyncs",
            "Worker ranks re-read in full after the consistency check found drift",
            ["model", "worker_id"],
            registry=r,
        )


class WorkerMetrics:
    """A worker's ``dynamo_component_*`` families (FACTS §10.1), labels pre-bound per endpoint."""

    def __init__(
        self, namespace: str, component: str, endpoint: str, registry: CollectorRegistry
    ) -> None:
        r = registry
        names = ["dynamo_namespace", "dynamo_component", "dynamo_endpoint"]
        values = (namespace, component, endpoint)
        self.requests = Counter(
            "dynamo_component_requests", "Requests served", names, registry=r
        ).labels(*values)
        self.inflight = Gauge(
            "dynamo_component_inflight_requests", "Requests in flight", names, registry=r
        ).labels(*values)
        self.request_bytes = Counter(
            "dynamo_component_request_bytes", "Request bytes received", names, registry=r
        ).labels(*values)
        self.response_bytes = Counter(
            "dynamo_component_response_bytes", "Response bytes sent", names, registry=r
        ).labels(*values)
        self.duration = Histogram(
            "dynamo_component_request_duration_seconds",
            "Request duration",
            names,
            registry=r,
            buckets=env_buckets("REQUEST_DURATION", 1, 512, 10),
        ).labels(*values)
        self._errors = Counter(
            "dynamo_component_errors", "Requests that failed", [*names, "error_type"], registry=r
        )
        self._values = values
        self.cancellations = Counter(
            "dynamo_component_cancellation", "Requests cancelled", names, registry=r
        ).labels(*values)
        self.uptime = Gauge("dynamo_component_uptime_seconds", "Seconds since start", registry=r)

    def error(self, error_type: str) -> None:
        self._errors.labels(*self._values, error_type).inc()


def observe_many(child: Any, values: Sequence[float]) -> None:
    """``child.observe(v)`` for every value, with one bucket increment per touched bucket.

    Per-token latencies are observed once per request instead of once per token (each
    ``observe`` takes a lock). Relies on prometheus_client's Histogram layout (pinned); falls
    back to plain ``observe`` if that ever changes.
    """
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None:
        for value in values:
            child.observe(value)
        return
    if not values:
        return
    counts: dict[int, int] = {}
    for value in values:
        i = bisect_left(bounds, value)
        counts[i] = counts.get(i, 0) + 1
    for i, n in counts.items():
        buckets[i].inc(n)
    total.inc(sum(values))

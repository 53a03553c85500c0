"""The engine's metrics on the worker's status server (``/metrics``), read from the step
loop's counters at scrape time.

The families every engine has (``dynamo_component_total_blocks``, ``..._gpu_cache_usage_percent``,
``..._kv_cache_hit_rate``, ``..._num_requests_*``, the ``disagg``/``kv_transfer`` counters) come
from :func:`rank_metrics`, the engine's ``metrics_snapshot()``, through the worker's
``EngineGauges``, as for every other engine; :class:`EngineCollector` adds this engine's own
step-loop counters (``dynamo_component_engine_*``) and the bytes a prefill worker sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from dynamo.backend.engine import DisaggCounters, RankMetrics
from dynamo.observability.collector import ScrapeCollector, counter, gauge

if TYPE_CHECKING:
    from dynamo.pytorch.engine import TorchEngine

PREFIX = "dynamo_component_"


def rank_metrics(engine: TorchEngine) -> list[RankMetrics]:
    """The engine's one rank now (none before ``start()``): KV blocks, requests, the prefix hit
    rate over all prompt tokens so far, and a disaggregated worker's transfer totals."""
    stats, sched = engine.stats, engine.scheduler
    if stats is None or sched is None:
        return []
    disagg = None
    transfer = engine.transfer
    if transfer is not None:
        t = transfer.stats
        prefill = engine.config.disaggregation_mode == "prefill"
        disagg = DisaggCounters(
            t.pulls_served if prefill else t.pulls, t.bytes_received, t.seconds_receiving
        )
    hit_rate = (
        stats.num_cached_tokens / stats.num_prompt_tokens if stats.num_prompt_tokens else None
    )
    return [
        RankMetrics(
            dp_rank=0,
            kv_total_blocks=sched.kv.num_blocks,
            kv_used_blocks=sched.kv.num_active_blocks,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            prefix_cache_hit_rate=hit_rate,
            disagg=disagg,
        )
    ]


class EngineCollector(ScrapeCollector):
    """The step loop's counters of one engine, labelled with its worker id (hex)."""

    def __init__(self, registry: CollectorRegistry, engine: TorchEngine, worker_id: int) -> None:
        self._engine = engine
        self._labels = ["worker_id"]
        self._values = [f"{worker_id:x}"]
        super().__init__(registry)

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats
        if stats is None:
            return
        labels, values = self._labels, self._values
        for name, doc, value in (
            ("engine_steps", "forward passes run", stats.num_steps),
            ("engine_step_seconds", "time spent in forward passes", stats.step_seconds),
            ("engine_batched_requests", "sum of requests over passes", stats.num_batched_requests),
            ("engine_batched_tokens", "sum of tokens over passes", stats.num_batched_tokens),
            ("engine_output_tokens", "tokens generated", stats.num_output_tokens),
            ("engine_preemptions", "requests preempted", stats.num_preemptions),
        ):
            yield counter(PREFIX + name, doc, labels, values, value)
        yield gauge(
            PREFIX + "engine_max_batch_requests",
            "largest batch so far",
            labels,
            values,
            stats.max_batch_requests,
        )
        transfer = self._engine.transfer
        if transfer is not None:
            yield counter(
                PREFIX + "kv_transfer_bytes_sent",
                "KV bytes sent to decode workers",
                labels,
                values,
                transfer.stats.bytes_sent,
            )

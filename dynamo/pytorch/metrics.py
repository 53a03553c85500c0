"""The engine's metrics on the worker's status server (``/metrics``), read from the step
loop's counters at scrape time. Names follow the reference's ``kvstats`` names
(``dynamo_component_total_blocks``, ``..._gpu_cache_usage_percent``, ``..._kv_cache_hit_rate``)
where they exist, ``dynamo_component_engine_*`` otherwise."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from dynamo.pytorch.engine import TorchEngine

PREFIX = "dynamo_component_"


class EngineCollector(Collector):
    def __init__(self, engine: TorchEngine, worker_id: int) -> None:
        self._engine = engine
        self._labels = ["worker_id"]
        self._values = [f"{worker_id:x}"]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats, sched = self._engine.stats, self._engine.scheduler
        if stats is None or sched is None:
            return
        kv = sched.kv

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=self._labels)
            g.add_metric(self._values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=self._labels)
            c.add_metric(self._values, value)
            return c

        yield gauge("total_blocks", "KV blocks in the pool", kv.num_blocks)
        yield gauge(
            "gpu_cache_usage_percent",
            "fraction of KV blocks in use (0-1)",
            kv.num_active_blocks / kv.num_blocks,
        )
        hit = stats.num_cached_tokens / stats.num_prompt_tokens if stats.num_prompt_tokens else 0.0
        yield gauge("kv_cache_hit_rate", "prefix cache hit rate over prompt tokens (0-1)", hit)
        yield gauge("engine_num_requests_running", "requests in the batch", sched.num_running)
        yield gauge("engine_num_requests_waiting", "requests queued", sched.num_waiting)
        yield counter("engine_steps", "forward passes run", stats.num_steps)
        yield counter("engine_step_seconds", "time spent in forward passes", stats.step_seconds)
        yield counter(
            "engine_batched_requests", "sum of requests over passes", stats.num_batched_requests
        )
        yield counter(
            "engine_batched_tokens", "sum of tokens over passes", stats.num_batched_tokens
        )
        yield counter("engine_output_tokens", "tokens generated", stats.num_output_tokens)
        yield counter("engine_preemptions", "requests preempted", stats.num_preemptions)
        yield gauge("engine_max_batch_requests", "largest batch so far", stats.max_batch_requests)
        transfer = self._engine.transfer
        if transfer is not None:  # disaggregation (names as the mocker's, DISAGG_COUNTERS)
            t = transfer.stats
            handoffs = (
                t.pulls_served if self._engine.config.disaggregation_mode == "prefill" else t.pulls
            )
            yield counter("disagg_handoffs", "remote prefills handed off or received", handoffs)
            yield counter(
                "kv_transfer_bytes", "KV bytes received from prefill workers", t.bytes_received
            )
            yield counter(
                "kv_transfer_seconds",
                "seconds receiving KV from prefill workers",
                t.seconds_receiving,
            )
            yield counter("kv_transfer_bytes_sent", "KV bytes sent to decode workers", t.bytes_sent)

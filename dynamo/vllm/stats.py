"""vLLM's scheduler statistics as the worker's per-rank gauges (``RankMetrics``).

vLLM reports a ``SchedulerStats`` (running and waiting requests, KV cache usage, prefix-cache
queries and hits) with every engine step to the stat loggers of its ``AsyncLLM``;
:meth:`SchedulerGauges.logger_factory` is such a logger, and :meth:`SchedulerGauges.snapshot`
turns the last report into what ``LLMEngine.metrics_snapshot()`` returns. vLLM sends a last
report after the step that frees an aborted or finished request, so the gauges go back to zero
when it is idle.

vLLM is imported only when the factory is called (inside ``AsyncLLM``'s construction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dynamo.backend.engine import DisaggCounters, RankMetrics


class SchedulerGauges:
    """The last scheduler report of one vLLM engine (dp rank 0), and its prefix-cache totals."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        # our KV connector's transfer totals (disaggregated workers; ``connector.py``)
        self.transfer_bytes = 0
        self.transfer_seconds = 0.0

    def record(self, stats: Any) -> None:
        """One vLLM ``SchedulerStats``."""
        self.num_running = int(stats.num_running_reqs)
        self.num_waiting = int(stats.num_waiting_reqs)
        self.kv_usage = float(stats.kv_cache_usage)
        prefix = stats.prefix_cache_stats
        if prefix is not None:
            self.prefix_queries += int(prefix.queries)
            self.prefix_hits += int(prefix.hits)
        transfers = getattr(stats, "kv_connector_stats", None)
        if transfers:
            self.transfer_bytes += int(transfers.get("bytes_received", 0))
            self.transfer_seconds += float(transfers.get("seconds_receiving", 0.0))

    def snapshot(self, total_blocks: int, handoffs: int | None = None) -> list[RankMetrics]:
        """``handoffs``: a disaggregated engine's handoffs so far (None: aggregated)."""
        hit_rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else None
        return [
            RankMetrics(
                dp_rank=0,
                kv_total_blocks=total_blocks,
                kv_used_blocks=round(self.kv_usage * total_blocks),
                num_running=self.num_running,
                num_waiting=self.num_waiting,
                prefix_cache_hit_rate=hit_rate,
                disagg=None
                if handoffs is None
                else DisaggCounters(handoffs, self.transfer_bytes, self.transfer_seconds),
            )
        ]

    def logger_factory(self) -> Callable[..., Any]:
        """A vLLM stat-logger factory whose loggers feed these gauges.

        It is a ``PrometheusStatLogger`` subclass that builds no metrics: vLLM adds its own
        ``PrometheusStatLogger`` to every ``AsyncLLM`` unless a given logger is one, and that
        logger's per-step work (a dozen counters, gauges and histograms updated on every engine
        step, ~28 % of this process's CPU per token at c=1, measured with a CPU-time profile)
        would feed prometheus_client's global registry, which no endpoint of ours serves (the
        worker's ``/metrics`` is its own registry). vLLM's periodic log line
        (``LoggingStatLogger``) is unaffected: it follows ``--disable-log-stats`` and vLLM's
        log level as in vLLM's own server."""
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        gauges = self

        class _Logger(PrometheusStatLogger):  # type: ignore[misc]  # vLLM is untyped here
            def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
                # no super().__init__(): it registers vLLM's metrics; this logger has none
                self.engine_indexes = engine_indexes or [0]

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    gauges.record(scheduler_stats)

            def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
                pass

            def record_admission_rejection(self, reason: str) -> None:
                pass

            def log(self) -> None:
                pass

            def log_engine_initialized(self) -> None:
                pass

        return _Logger

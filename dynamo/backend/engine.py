"""``LLMEngine``: the boundary between the framework and an inference engine (spec 000).

Lifecycle, in order:

1. ``start(worker_id)`` once: load the model, return an :class:`EngineConfig` (non-empty model).
2. ``generate(request, ctx)``: called concurrently, once per request. Returns an async iterator of
   :class:`LLMEngineOutput`. Exactly one *terminal* (a chunk with ``finish_reason`` set, or a raised
   :class:`DynamoError`) ends the stream and nothing follows it. Between yields the engine polls
   ``ctx.is_stopped()`` and, when stopped, ends with a ``cancelled`` terminal. Resources held by a
   request must be freed on every exit path (``finally`` inside the generator), because the
   consumer may simply stop iterating.
3. ``abort(ctx)``: called by the framework's monitor when a request's context is stopped or
   killed. Default no-op; override for engine-side cancel notification.
4. ``drain()``: called on shutdown after the worker left discovery and the grace period ran out;
   finish or fail in-flight work. Default no-op.
5. ``cleanup()``: release everything. Must be idempotent (a second call is a no-op) and must work
   on an engine whose ``start()`` never ran or failed half-way.

Optional, at any time after ``start()``: ``metrics_snapshot()`` (per-rank gauges for the worker's
``/metrics``, read at every scrape) and ``health_check_payload()`` (the canary request the worker
sends through the normal path when the endpoint is idle; FACTS §8).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from dynamo.protocol.model_card import EngineCapabilities
from dynamo.protocol.output import FinishReason, LLMEngineOutput, Usage
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.context import Context

GenerateContext = Context
"""The per-request context handed to ``generate`` (id, stop/kill signals)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What ``start()`` reports about the loaded engine; registered in the model card."""

    model: str
    served_model_name: str | None = None
    context_length: int = 8192
    kv_block_size: int = 16
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_size: int = 1
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    # What the engine honours beyond the basic fields (the model card's ``capabilities``); the
    # frontend answers 400 for a request that needs anything not advertised here.
    capabilities: EngineCapabilities = EngineCapabilities()
    # False: this engine publishes no KV events (explicitly disabled; the card's ``kv_events``).
    kv_events: bool = True

    @property
    def name(self) -> str:
        """The name clients use for the model."""
        return self.served_model_name or self.model


@dataclass(slots=True)
class DisaggCounters:
    """A disaggregated rank's running totals since start: ``handoffs`` are remote prefills
    served (prefill role: handoffs produced; decode role: handoffs received), with the KV bytes
    and the seconds their transfers took (decode role; the mocker reports its model's)."""

    handoffs: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class RankMetrics:
    """One data-parallel rank's state right now, for the worker's ``dynamo_component_*`` gauges.

    ``prefix_cache_hit_rate`` is None when there is no measurement yet (or no prefix cache), so
    the gauge is left out rather than reported as 0.
    """

    dp_rank: int
    kv_total_blocks: int
    kv_used_blocks: int
    num_running: int
    num_waiting: int
    prefix_cache_hit_rate: float | None = None
    disagg: DisaggCounters | None = None

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use (0.0-1.0)."""
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


class LLMEngine(ABC):
    """Implement this to plug an engine into dynamo-py (see module docstring for the contract)."""

    @abstractmethod
    async def start(self, worker_id: int) -> EngineConfig: ...

    @abstractmethod
    def generate(
        self, request: PreprocessedRequest, ctx: GenerateContext
    ) -> AsyncIterator[LLMEngineOutput]: ...

    async def abort(self, ctx: Context) -> None:  # noqa: B027 - optional hook, default no-op
        """Engine-side cancel notification (default: rely on in-stream polling)."""

    async def drain(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Finish in-flight work before cleanup (default: nothing to drain)."""

    @abstractmethod
    async def cleanup(self) -> None: ...

    def metrics_snapshot(self) -> Sequence[RankMetrics]:
        """Per-rank gauges, read by the worker at every ``/metrics`` scrape (on the event loop:
        return quickly, from state the engine already keeps). Default: none."""
        return ()

    def health_check_payload(self) -> PreprocessedRequest | None:
        """The minimal request a health-check canary sends through this engine's endpoint when
        it has been idle (one token is enough). ``DYN_HEALTH_CHECK_PAYLOAD`` overrides it.
        Default: None (no canary unless the operator configures a payload)."""
        return None


class chunk:  # noqa: N801 - a namespace of constructors, read as chunk.token(...)
    """Constructors for engine output chunks (spec 000's chunk helpers)."""

    @staticmethod
    def token(token_id: int) -> LLMEngineOutput:
        return LLMEngineOutput(token_ids=[token_id])

    @staticmethod
    def tokens(token_ids: list[int]) -> LLMEngineOutput:
        return LLMEngineOutput(token_ids=token_ids)

    @staticmethod
    def stop() -> LLMEngineOutput:
        return LLMEngineOutput(finish_reason=FinishReason.STOP)

    @staticmethod
    def length() -> LLMEngineOutput:
        return LLMEngineOutput(finish_reason=FinishReason.LENGTH)

    @staticmethod
    def cancelled() -> LLMEngineOutput:
        return LLMEngineOutput(finish_reason=FinishReason.CANCELLED)

    @staticmethod
    def error(message: str) -> LLMEngineOutput:
        return LLMEngineOutput(finish_reason=FinishReason.ERROR, error=message)


def with_tokens(output: LLMEngineOutput, token_ids: list[int]) -> LLMEngineOutput:
    """Attach tokens to a (terminal) chunk."""
    output.token_ids = token_ids
    return output


def with_usage(
    output: LLMEngineOutput,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
) -> LLMEngineOutput:
    """Attach usage to a (terminal) chunk."""
    output.usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
    )
    return output

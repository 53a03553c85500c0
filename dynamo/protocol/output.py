"""Engine output chunks: what a worker streams back for one request."""

from __future__ import annotations

from enum import StrEnum

import msgspec

from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.request import TraceLink


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class Usage(msgspec.Struct, omit_defaults=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None


class TopLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One alternative at a position: token id and its log-probability (most likely first)."""

    token_id: int
    logprob: float


class LLMEngineOutput(msgspec.Struct, omit_defaults=True, kw_only=True, gc=False):
    """One chunk of an engine's stream.

    A chunk with ``finish_reason`` set is a *terminal*: exactly one terminal ends every stream, and
    nothing follows it. ``error`` carries the message of an ``ERROR`` terminal. (A request with
    n > 1 choices reaches engines as n requests, so a stream is always one choice.)
    """

    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    disaggregated_params: DisaggregatedParams | None = None
    # Set only when the request asked for them (OutputOptions): one entry per token of
    # ``token_ids`` (the chosen token's log-probability) and, per token, its top alternatives.
    log_probs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    # Prompt log-probabilities (OutputOptions.prompt_logprobs), on the first chunk only; the
    # first prompt token has none (``None``).
    prompt_logprobs: list[float | None] | None = None
    # The worker's ``engine.generate`` span, on the first chunk with tokens (or the terminal):
    # a successor request (decode after prefill, a migration retry) links to it.
    worker_trace_link: TraceLink | None = None

    @property
    def is_terminal(self) -> bool:
        return self.finish_reason is not None

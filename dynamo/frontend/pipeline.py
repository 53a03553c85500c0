"""What the request path shares: the per-model pipeline and the per-request accounting types.

The request path itself is split by concern: ``attempt.py`` (route + transport to one instance),
``choice.py`` (detokenize + stop strings + stats for one ``n`` index, and merging choices),
``inflight.py`` (the one owner of a request), ``generate.py`` (the HTTP handlers). This module
holds only data, so each of those imports it without a cycle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynamo.frontend.logprobs import TokenLogprobs
from dynamo.observability.metrics import FrontendMetrics
from dynamo.preprocess import Preprocessor
from dynamo.protocol.request import TraceLink
from dynamo.router.basic import Selection

if TYPE_CHECKING:
    from dynamo.frontend.disagg import Disaggregation


@dataclass(slots=True)
class ModelPipeline:
    """The per-model preprocessing (tokenizer, template, context length), built from the model's
    first serving (aggregated or decode) worker's card. Routers live in the registry's entry,
    one per worker role. ``disagg`` decides and runs remote prefills when the model has decode
    workers (None: the frontend never disaggregates)."""

    name: str
    preprocessor: Preprocessor
    metrics: FrontendMetrics | None = None  # the frontend's (stage timings of routing)
    disagg: Disaggregation | None = None


@dataclass(slots=True)
class ChoiceDelta:
    """New text for one choice; ``finish_reason`` set on the choice's last delta."""

    index: int
    text: str
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    logprobs: TokenLogprobs | None = None  # set when the request asked for log-probabilities


@dataclass(slots=True)
class ChoiceStats:
    """Per-choice accounting, filled while streaming (usage, timing, placement)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    dispatched_at: float | None = None  # routed, sent to the worker (nvext timing)
    # The handoff of the remote prefill the first token resumed from arrived (disaggregated).
    prefill_done_at: float | None = None
    itls: list[float] = field(default_factory=list)
    selection: Selection | None = None
    # The worker's engine.generate span of the latest attempt: a retry links to it
    # (``tracing.with_predecessor``).
    trace_link: TraceLink | None = None


@dataclass(slots=True)
class RunStats:
    """One HTTP request's accounting. ``prompt_tokens`` counts each prompt once (n choices of a
    prompt share it), as OpenAI's usage does."""

    choices: list[ChoiceStats]
    prompt_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)  # when the HTTP request arrived

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int | None:
        values = [c.cached_tokens for c in self.choices if c.cached_tokens is not None]
        return sum(values) if values else None

    @property
    def first_token_at(self) -> float | None:
        times = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        return min(times) if times else None

"""``Collector``: the outputs of one request on their way from the step loop to its
``generate`` consumer. Tokens (and their log-probabilities) pile up while the consumer is busy
and leave together in one chunk (coalescing). Used on the event loop thread only."""

from __future__ import annotations

import asyncio

from dynamo.protocol.output import FinishReason, LLMEngineOutput, TopLogprob
from dynamo.runtime.context import Context
from dynamo.runtime.errors import DynamoError


class Collector:
    __slots__ = (
        "tokens",
        "log_probs",
        "top_logprobs",
        "terminal",
        "error",
        "done",
        "cancelled",
        "waiter",
        "prompt_logprobs",
        "_logprobs",
    )

    def __init__(self, *, logprobs: bool) -> None:
        self._logprobs = logprobs
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.top_logprobs: list[list[TopLogprob]] = []
        self.terminal: FinishReason | None = None
        self.error: DynamoError | None = None
        self.done = False  # the step loop no longer knows the request
        self.cancelled = False  # abort(ctx) freed it: end with a cancelled terminal
        self.waiter: asyncio.Future[None] | None = None  # set while the consumer waits
        self.prompt_logprobs: list[float | None] | None = None  # until the first chunk leaves

    @property
    def has_tokens(self) -> bool:
        return bool(self.tokens)

    def add(self, token: int, logprob: float | None, top: list[TopLogprob]) -> None:
        self.tokens.append(token)
        if self._logprobs:
            self.log_probs.append(logprob if logprob is not None else 0.0)
            self.top_logprobs.append(top)
        self.wake()

    def take(self, finish_reason: FinishReason | None) -> LLMEngineOutput:
        """Everything collected so far as one chunk (a terminal when ``finish_reason`` is set)."""
        out = LLMEngineOutput(token_ids=self.tokens, finish_reason=finish_reason)
        if self._logprobs:
            out.log_probs, out.top_logprobs = self.log_probs, self.top_logprobs
            self.log_probs, self.top_logprobs = [], []
        if self.prompt_logprobs is not None:
            out.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        self.tokens = []
        return out

    def wake(self, _ctx: Context | None = None) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

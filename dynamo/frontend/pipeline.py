"""The request flow in one file: preprocess -> route -> transport -> detokenize.

``ModelPipeline`` is built once per model (from its first model card). ``run_choices`` turns one
preprocessed request (n choices, or a prompt batch) into a single stream of :class:`ChoiceDelta`
in arrival order; the HTTP layer formats them as OpenAI chunks (streaming) or folds them (unary).
Every exit path (end, error, client disconnect) frees the request's router load and cancels the
engine-side request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

import msgspec

from dynamo.frontend.logprobs import LogprobCollector, TokenLogprobs
from dynamo.frontend.model_registry import ModelEntry
from dynamo.preprocess import Prepared, Preprocessor
from dynamo.protocol.model_card import ModelCard
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import RoutingHints
from dynamo.router.basic import Router, Selection
from dynamo.runtime.context import Context
from dynamo.runtime.errors import Cancelled, NoInstances, Unknown

_request_encoder = msgspec.msgpack.Encoder()
_output_decoder = msgspec.msgpack.Decoder(LLMEngineOutput)

DRAIN_TIMEOUT_S = 1.0
"""After a stop string ends a choice, how long to wait for the engine's cancelled terminal
(which carries usage, e.g. cached tokens) before giving up on it."""


@dataclass(slots=True)
class ModelPipeline:
    """Everything per model: its preprocessor (tokenizer, template) and its router."""

    name: str
    preprocessor: Preprocessor
    router: Router


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
    itls: list[float] = field(default_factory=list)
    selection: Selection | None = None


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


_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def _candidates(entry: ModelEntry[ModelPipeline]) -> list[ModelCard]:
    role = entry.serving_role()
    live = entry.live_instance_ids(role)
    if not live:
        raise NoInstances(f"Model temporarily unavailable: {entry.name!r} has no live instance")
    return [entry.cards[i] for i in live]


async def stream_choice(
    entry: ModelEntry[ModelPipeline],
    prepared: Prepared,
    ctx: Context,
    index: int,
    stats: ChoiceStats,
    *,
    want_token_ids: bool = False,
) -> AsyncGenerator[ChoiceDelta, None]:
    """One choice: route, send, detokenize. Raises DynamoError on failure."""
    pipeline = entry.pipeline
    request = prepared.request
    request_id = request.request_id or ctx.id
    stats.prompt_tokens = len(request.token_ids)
    selection = pipeline.router.select(request, _candidates(entry))
    stats.selection = selection
    stats.dispatched_at = time.monotonic()
    if selection.dp_rank is not None:
        hints = request.routing or RoutingHints()
        hints.dp_rank = selection.dp_rank
        request.routing = hints
    client = entry.clients[entry.serving_role()]
    detok = pipeline.preprocessor.detokenizer(prepared)
    lp = LogprobCollector.for_request(request)
    # Batches: every chunk received while we were busy is handled at once (one detokenizer
    # call, one delta, one write to the HTTP client): coalescing when the consumer is behind.
    stream = client.stream_batches(
        _request_encoder.encode(request), ctx, instance_id=selection.instance_id
    )
    first = True
    try:
        async for batch in stream:
            token_ids, reason, error = _merge(batch, stats, lp)
            if token_ids:
                now = time.monotonic()
                if first:
                    first = False
                    stats.first_token_at = now
                    pipeline.router.on_first_token(request_id)
                elif stats.last_token_at is not None:
                    stats.itls.append(now - stats.last_token_at)
                stats.last_token_at = now
                res = detok.add(token_ids)
                stats.completion_tokens = detok.num_tokens
                ids = token_ids if want_token_ids else None
                lps = None if lp is None else lp.take(detok.num_tokens)
                if res.finished is not None:
                    yield ChoiceDelta(index, res.text, "stop", ids, lps)
                    if reason is None:
                        await _drain_after_stop(stream, ctx, stats)
                    return
                if reason is None:
                    if res.text or ids or (lps is not None and lps.token_ids):
                        yield ChoiceDelta(index, res.text, None, ids, lps)
                    continue
                text = res.text
            else:
                ids = lps = None
                text = ""
                if reason is None:
                    continue
            if reason is FinishReason.ERROR:
                raise Unknown(error or "engine error")
            if reason is FinishReason.CANCELLED:
                raise Cancelled("the engine cancelled the request")
            text += detok.flush().text
            if lp is not None and lps is None:
                lps = lp.take(detok.num_tokens)
            yield ChoiceDelta(index, text, _FINISH[reason], ids, lps)
            return
    finally:
        await stream.aclose()
        pipeline.router.on_finish(request_id)


def _merge(
    batch: list[bytes], stats: ChoiceStats, lp: LogprobCollector | None = None
) -> tuple[list[int], FinishReason | None, str | None]:
    """Decode a batch of engine chunks: their tokens, and the terminal's reason and error (a
    terminal is always the stream's last chunk). Records cached tokens from usage, and
    log-probabilities into ``lp``."""
    decode = _output_decoder.decode
    if len(batch) == 1:
        out = decode(batch[0])
        if lp is not None:
            lp.add(out)
        if out.usage is not None and out.usage.cached_tokens is not None:
            stats.cached_tokens = out.usage.cached_tokens
        return out.token_ids, out.finish_reason, out.error
    token_ids: list[int] = []
    reason: FinishReason | None = None
    error: str | None = None
    for raw in batch:
        out = decode(raw)
        if lp is not None:
            lp.add(out)
        token_ids += out.token_ids
        if out.usage is not None and out.usage.cached_tokens is not None:
            stats.cached_tokens = out.usage.cached_tokens
        if out.finish_reason is not None:
            reason, error = out.finish_reason, out.error
    return token_ids, reason, error


async def _drain_after_stop(
    stream: AsyncIterator[list[bytes]], ctx: Context, stats: ChoiceStats
) -> None:
    """A stop string ended the choice: cancel the engine and wait briefly for its terminal."""
    ctx.stop_generating()
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for batch in stream:
                if _merge(batch, stats)[1] is not None:
                    return
    except (TimeoutError, Exception):  # the choice is complete either way
        return


def run_choices(
    entry: ModelEntry[ModelPipeline],
    prepared: Sequence[Prepared],
    ctx: Context,
    stats: RunStats,
    *,
    want_token_ids: bool = False,
) -> AsyncGenerator[ChoiceDelta, None]:
    """All choices of one HTTP request, merged in arrival order (choice i = prepared[i])."""
    if len(prepared) == 1:  # the common case: the choice's own stream, no tasks, no queue
        return stream_choice(
            entry, prepared[0], ctx, 0, stats.choices[0], want_token_ids=want_token_ids
        )
    return _merge_choices(entry, prepared, ctx, stats, want_token_ids)


async def _merge_choices(
    entry: ModelEntry[ModelPipeline],
    prepared: Sequence[Prepared],
    ctx: Context,
    stats: RunStats,
    want_token_ids: bool,
) -> AsyncGenerator[ChoiceDelta, None]:
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        child = ctx.child(f"{ctx.id}-{i}")
        try:
            async for delta in stream_choice(
                entry, prepared[i], child, i, stats.choices[i], want_token_ids=want_token_ids
            ):
                await queue.put(delta)
            await queue.put(None)
        except BaseException as exc:  # forwarded to the consumer, which raises it
            await queue.put(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            child.detach()

    tasks = [
        asyncio.create_task(pump(i), name=f"choice-{ctx.id}-{i}") for i in range(len(prepared))
    ]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""Choices: detokenize, apply stop strings and keep stats for one ``n`` index, and merge the
choices of one request into one stream of :class:`ChoiceDelta` in arrival order.

A choice consumes the engine outputs of its attempts (``attempt.py``); it never routes or talks
to the transport itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING

from dynamo.frontend.attempt import Load, Timeouts, attempts
from dynamo.frontend.logprobs import LogprobCollector
from dynamo.frontend.migration import NO_MIGRATION, MigrationPolicy
from dynamo.frontend.pipeline import ChoiceDelta, ChoiceStats, RunStats
from dynamo.preprocess import Prepared
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.runtime.context import Context
from dynamo.runtime.errors import Cancelled, Unknown

if TYPE_CHECKING:
    from dynamo.frontend.model_registry import ModelEntry
    from dynamo.frontend.pipeline import ModelPipeline

DRAIN_TIMEOUT_S = 1.0
"""After a stop string ends a choice, how long to wait for the engine's cancelled terminal
(which carries usage, e.g. cached tokens) before giving up on it."""

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


async def stream_choice(
    entry: ModelEntry[ModelPipeline],
    prepared: Prepared,
    ctx: Context,
    index: int,
    stats: ChoiceStats,
    loads: list[Load],
    timeouts: Timeouts,
    *,
    want_token_ids: bool = False,
    migration: MigrationPolicy = NO_MIGRATION,
) -> AsyncGenerator[ChoiceDelta, None]:
    """One choice: its attempts' tokens, detokenized. Raises DynamoError on failure."""
    request = prepared.request
    stats.prompt_tokens = len(request.token_ids)
    assert entry.pipeline is not None  # the registry hands out servable models only
    detok = entry.pipeline.preprocessor.detokenizer(prepared)
    lp = LogprobCollector.for_request(request)
    outputs = attempts(entry, request, ctx, stats, loads, timeouts, migration)
    first = True
    try:
        async for batch in outputs:
            token_ids, reason, error = _merge(batch, stats, lp)
            if token_ids:
                now = time.monotonic()
                if first:
                    first = False
                    stats.first_token_at = now
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
                        await _drain_after_stop(outputs, ctx, stats)
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
        await outputs.aclose()


def _merge(
    batch: list[LLMEngineOutput], stats: ChoiceStats, lp: LogprobCollector | None = None
) -> tuple[list[int], FinishReason | None, str | None]:
    """A batch of engine chunks as one: their tokens, and the terminal's reason and error (a
    terminal is always the stream's last chunk). Records cached tokens from usage, and
    log-probabilities into ``lp``."""
    if len(batch) == 1:
        out = batch[0]
        if lp is not None:
            lp.add(out)
        if out.usage is not None and out.usage.cached_tokens is not None:
            stats.cached_tokens = out.usage.cached_tokens
        return out.token_ids, out.finish_reason, out.error
    token_ids: list[int] = []
    reason: FinishReason | None = None
    error: str | None = None
    for out in batch:
        if lp is not None:
            lp.add(out)
        token_ids += out.token_ids
        if out.usage is not None and out.usage.cached_tokens is not None:
            stats.cached_tokens = out.usage.cached_tokens
        if out.finish_reason is not None:
            reason, error = out.finish_reason, out.error
    return token_ids, reason, error


async def _drain_after_stop(
    outputs: AsyncIterator[list[LLMEngineOutput]], ctx: Context, stats: ChoiceStats
) -> None:
    """A stop string ended the choice: cancel the engine and wait briefly for its terminal."""
    ctx.stop_generating()
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for batch in outputs:
                if _merge(batch, stats)[1] is not None:
                    return
    except (TimeoutError, Exception):  # the choice is complete either way
        return


def run_choices(
    entry: ModelEntry[ModelPipeline],
    prepared: Sequence[Prepared],
    ctx: Context,
    stats: RunStats,
    loads: list[Load],
    timeouts: Timeouts,
    *,
    want_token_ids: bool = False,
    migration: MigrationPolicy = NO_MIGRATION,
) -> AsyncGenerator[ChoiceDelta, None]:
    """All choices of one HTTP request, merged in arrival order (choice i = prepared[i])."""
    if len(prepared) == 1:  # the common case: the choice's own stream, no tasks, no queue
        return stream_choice(
            entry,
            prepared[0],
            ctx,
            0,
            stats.choices[0],
            loads,
            timeouts,
            want_token_ids=want_token_ids,
            migration=migration,
        )
    return _merge_choices(entry, prepared, ctx, stats, loads, timeouts, want_token_ids, migration)


async def _merge_choices(
    entry: ModelEntry[ModelPipeline],
    prepared: Sequence[Prepared],
    ctx: Context,
    stats: RunStats,
    loads: list[Load],
    timeouts: Timeouts,
    want_token_ids: bool,
    migration: MigrationPolicy,
) -> AsyncGenerator[ChoiceDelta, None]:
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        child = ctx.child(f"{ctx.id}-{i}")
        try:
            async for delta in stream_choice(
                entry,
                prepared[i],
                child,
                i,
                stats.choices[i],
                loads,
                timeouts,
                want_token_ids=want_token_ids,
                migration=migration,
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

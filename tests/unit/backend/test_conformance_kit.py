"""The conformance kit passes a correct engine and names each broken engine's failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamo.backend.engine import EngineConfig, chunk
from dynamo.backend.testing import CHECKS, cancelling_context, check_engine, mock_context
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.context import Context
from tests.fakes import CountingEngine


class EmptyModel(CountingEngine):
    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="")


class NoTerminal(CountingEngine):
    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if ctx.is_stopped():
            yield chunk.cancelled()
            return
        yield chunk.token(1)


class AfterTerminal(CountingEngine):
    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        async for out in super().generate(request, ctx):
            yield out
        yield chunk.token(5)


class NotReentrant(CountingEngine):
    busy = False

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if self.busy:
            raise RuntimeError("one request at a time")
        self.busy = True
        try:
            async for out in super().generate(request, ctx):
                await asyncio.sleep(0)
                yield out
        finally:
            self.busy = False


class DeafToCancel(CountingEngine):
    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        n = request.stop.max_tokens or 8
        for i in range(n):
            await asyncio.sleep(0.001)
            yield chunk.token(i)
        yield chunk.length()


class IgnoresCancelReason(CountingEngine):
    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        for i in range(request.stop.max_tokens or 8):
            if ctx.is_stopped():
                yield chunk.stop()
                return
            await asyncio.sleep(0.001)
            yield chunk.token(i)
        yield chunk.length()


class CleanupOnce(CountingEngine):
    done = False

    async def cleanup(self) -> None:
        if self.done:
            raise RuntimeError("already cleaned up")
        self.done = True


class CleanupNeedsStart(CountingEngine):
    started = False

    async def start(self, worker_id: int) -> EngineConfig:
        self.started = True
        return await super().start(worker_id)

    async def cleanup(self) -> None:
        if not self.started:
            raise RuntimeError("cleanup before start")


async def test_correct_engine_passes() -> None:
    report = await check_engine(lambda: CountingEngine(delay=0.001))
    assert report.ok, report.failures


@pytest.mark.parametrize(
    ("engine_cls", "failure"),
    [
        (EmptyModel, "EmptyModelInConfig"),
        (NoTerminal, "NoTerminalChunk"),
        (AfterTerminal, "ChunkAfterTerminal"),
        (NotReentrant, "ConcurrentGenerateFailed"),
        (DeafToCancel, "CancellationNotObserved"),
        (IgnoresCancelReason, "CancellationIgnored"),
        (CleanupOnce, "SecondCleanupFailed"),
        (CleanupNeedsStart, "CleanupWithoutStartFailed"),
    ],
)
async def test_each_check_catches_its_broken_engine(engine_cls: type, failure: str) -> None:
    kwargs = {"delay": 0.001} if engine_cls is not DeafToCancel else {}
    report = await check_engine(
        lambda: engine_cls(**kwargs),
        long_tokens=100_000 if engine_cls is not DeafToCancel else 5000,
    )
    assert failure in report.failures, report.failures
    assert failure in CHECKS


async def test_contexts() -> None:
    ctx = mock_context("abc")
    assert ctx.id == "abc" and not ctx.is_stopped()
    cctx = cancelling_context(0.01)
    await asyncio.wait_for(cctx.stopped(), 1)
    assert cctx.is_stopped() and not cctx.is_killed()

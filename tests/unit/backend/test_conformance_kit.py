"""The conformance kit passes a correct engine and names each broken engine's failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamo.backend.engine import EngineConfig, chunk
from dynamo.backend.testing import (
    CHECKS,
    ConformanceReport,
    cancelling_context,
    check_engine,
    mock_context,
)
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
    report = await check_engine(lambda: engine_cls(**kwargs))  # the kit's defaults
    assert failure in report.failures, report.failures
    assert set(report.failures) <= set(CHECKS)


class CrashesInGenerate(CountingEngine):
    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        raise RuntimeError("boom")
        yield chunk.stop()  # pragma: no cover - makes this a generator


class CrashesInStart(CountingEngine):
    async def start(self, worker_id: int) -> EngineConfig:
        raise RuntimeError("no GPU")


class CrashesWhenCancelled(CountingEngine):
    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        async for out in super().generate(request, ctx):
            if out.finish_reason is not None and ctx.is_stopped():
                raise RuntimeError("cancel handling crashed")
            yield out


@pytest.mark.parametrize(
    ("engine_cls", "failure", "detail"),
    [
        (CrashesInStart, "EmptyModelInConfig", "start() raised RuntimeError: no GPU"),
        (CrashesInGenerate, "NoTerminalChunk", "raised RuntimeError: boom"),
        (CrashesWhenCancelled, "CancellationIgnored", "raised RuntimeError: cancel handling"),
    ],
)
async def test_a_crash_is_reported_under_the_running_check(
    engine_cls: type, failure: str, detail: str
) -> None:
    report = await check_engine(lambda: engine_cls(delay=0.001))
    assert detail in report.failures.get(failure, ""), report.failures
    assert set(report.failures) <= set(CHECKS)


def test_only_the_eight_names_can_be_reported() -> None:
    report = ConformanceReport()
    with pytest.raises(ValueError, match="EngineError"):
        report.fail("EngineError", "x")
    report.fail("NoTerminalChunk", "first")
    report.fail("NoTerminalChunk", "second")
    assert report.failures == {"NoTerminalChunk": "first"} and not report.ok


async def test_the_long_stream_fits_the_engine_context() -> None:
    seen: list[int] = []

    class Recording(CountingEngine):
        async def generate(
            self, request: PreprocessedRequest, ctx: Context
        ) -> AsyncIterator[LLMEngineOutput]:
            seen.append(len(request.token_ids) + (request.stop.max_tokens or 0))
            async for out in super().generate(request, ctx):
                yield out

    report = await check_engine(lambda: Recording(delay=0.001))
    assert report.ok, report.failures
    assert max(seen) == 4096  # CountingEngine's context_length


async def test_contexts() -> None:
    ctx = mock_context("abc")
    assert ctx.id == "abc" and not ctx.is_stopped()
    cctx = cancelling_context(0.01)
    await asyncio.wait_for(cctx.stopped(), 1)
    assert cctx.is_stopped() and not cctx.is_killed()

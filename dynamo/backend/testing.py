"""The conformance kit (spec 000): eight checks every ``LLMEngine`` must pass.

Usage::

    report = await check_engine(lambda: MyEngine(...))
    assert report.ok, report.failures

Each failed check is reported by its spec name (``EmptyModelInConfig``, ``NoTerminalChunk``,
``ChunkAfterTerminal``, ``ConcurrentGenerateFailed``, ``CancellationNotObserved``,
``CancellationIgnored``, ``SecondCleanupFailed``, ``CleanupWithoutStartFailed``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo.backend.engine import LLMEngine
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo.runtime.context import Context

CANCELLATION_DEADLINE_S = 2.0
PROMPT_TOKENS = 32
"""Length of every request's prompt."""

CHECKS = (
    "EmptyModelInConfig",
    "NoTerminalChunk",
    "ChunkAfterTerminal",
    "ConcurrentGenerateFailed",
    "CancellationNotObserved",
    "CancellationIgnored",
    "SecondCleanupFailed",
    "CleanupWithoutStartFailed",
)


def mock_context(request_id: str | None = None) -> Context:
    """A fresh, live context."""
    return Context(request_id)


def cancelling_context(after: float, request_id: str | None = None) -> Context:
    """A context that stops itself ``after`` seconds (must be called inside a running loop)."""
    ctx = Context(request_id)
    asyncio.get_running_loop().call_later(after, ctx.stop_generating)
    return ctx


@dataclass
class ConformanceReport:
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, name: str, detail: str) -> None:
        if name not in CHECKS:
            raise ValueError(f"{name!r} is not one of the conformance checks")
        self.failures.setdefault(name, detail)


def default_request(model: str, max_tokens: int, index: int = 0) -> PreprocessedRequest:
    return PreprocessedRequest(
        model=model,
        token_ids=[(7 * i + index) % 97 + 3 for i in range(PROMPT_TOKENS)],
        request_id=f"conformance-{index}",
        sampling=SamplingOptions(seed=index),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


async def _collect(
    engine: LLMEngine, request: PreprocessedRequest, ctx: Context
) -> tuple[list[LLMEngineOutput], int | None]:
    """All chunks, and the index of the first terminal (None if none)."""
    chunks: list[LLMEngineOutput] = []
    first_terminal: int | None = None
    async for out in engine.generate(request, ctx):
        if out.finish_reason is not None and first_terminal is None:
            first_terminal = len(chunks)
        chunks.append(out)
    return chunks, first_terminal


async def check_engine(
    factory: Callable[[], LLMEngine],
    *,
    short_tokens: int = 8,
    long_tokens: int | None = None,
    concurrency: int = 4,
    cancel_after: float = 0.05,
) -> ConformanceReport:
    """Run the eight checks against fresh engines from ``factory``.

    ``long_tokens`` is the length of the stream the cancellation check cancels; by default as
    long as the engine's context allows after the prompt (``EngineConfig.context_length``), so
    the defaults pass any correct engine. The cancel fires at the first chunk or after
    ``cancel_after`` seconds, whichever comes first, so even a very fast engine is cancelled
    mid-stream. Whatever goes wrong, it is reported under the name of the check that was
    running (one of ``CHECKS``); the kit itself never raises.
    """
    report = ConformanceReport()
    await _check_cleanup_without_start(factory, report)
    engine = factory()
    check = "EmptyModelInConfig"  # the check whose code is running (a crash is reported there)
    try:
        config = await engine.start(0)
        if not config.model:
            report.fail(check, "start() returned an empty model")
        model = config.model or "model"
        if long_tokens is None:
            long_tokens = max(short_tokens, config.context_length - PROMPT_TOKENS)
        check = "NoTerminalChunk"
        await _check_single(engine, model, short_tokens, report)
        check = "ConcurrentGenerateFailed"
        await _check_concurrent(engine, model, short_tokens, concurrency, report)
        check = "CancellationIgnored"
        await _check_cancellation(engine, model, long_tokens, cancel_after, report)
    except Exception as exc:  # a crash in any check fails that check, never the caller
        verb = "start() raised" if check == "EmptyModelInConfig" else "raised"
        report.fail(check, f"{verb} {type(exc).__name__}: {exc}")
    finally:
        await _check_cleanup_twice(engine, report)
    return report


async def _check_single(engine: LLMEngine, model: str, n: int, report: ConformanceReport) -> None:
    chunks, first = await _collect(engine, default_request(model, n), mock_context())
    if first is None:
        report.fail("NoTerminalChunk", f"{len(chunks)} chunks, none terminal")
    elif first != len(chunks) - 1:
        report.fail("ChunkAfterTerminal", f"{len(chunks) - 1 - first} chunk(s) after terminal")


async def _check_concurrent(
    engine: LLMEngine, model: str, n: int, concurrency: int, report: ConformanceReport
) -> None:
    results = await asyncio.gather(
        *(
            _collect(engine, default_request(model, n, i + 1), mock_context())
            for i in range(concurrency)
        ),
        return_exceptions=True,
    )
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            report.fail("ConcurrentGenerateFailed", f"stream {i} raised {result!r}")
            return
        chunks, first = result
        if first is None or chunks[first].finish_reason is FinishReason.ERROR:
            report.fail("ConcurrentGenerateFailed", f"stream {i} did not finish cleanly")
            return


async def _check_cancellation(
    engine: LLMEngine, model: str, n: int, after: float, report: ConformanceReport
) -> None:
    ctx = cancelling_context(after)
    chunks: list[LLMEngineOutput] = []
    first: int | None = None
    try:
        async with asyncio.timeout(after + CANCELLATION_DEADLINE_S):
            async for out in engine.generate(default_request(model, n, 99), ctx):
                if out.finish_reason is not None and first is None:
                    first = len(chunks)
                chunks.append(out)
                ctx.stop_generating()  # mid-stream: at the first chunk at the latest
    except TimeoutError:
        report.fail(
            "CancellationNotObserved",
            f"stream still running {CANCELLATION_DEADLINE_S}s after cancel",
        )
        return
    if first == 0 and len(chunks) == 1 and chunks[0].finish_reason is not FinishReason.CANCELLED:
        report.fail(
            "CancellationNotObserved",
            f"the whole stream ({n} tokens) came as one chunk before the cancel could fire",
        )
        return
    if first is None or chunks[first].finish_reason is not FinishReason.CANCELLED:
        reason = None if first is None else chunks[first].finish_reason
        report.fail("CancellationIgnored", f"terminal after cancel was {reason}")


async def _check_cleanup_twice(engine: LLMEngine, report: ConformanceReport) -> None:
    try:
        await engine.cleanup()
        await engine.cleanup()
    except Exception as exc:
        report.fail("SecondCleanupFailed", f"{type(exc).__name__}: {exc}")


async def _check_cleanup_without_start(
    factory: Callable[[], LLMEngine], report: ConformanceReport
) -> None:
    try:
        await factory().cleanup()
    except Exception as exc:
        report.fail("CleanupWithoutStartFailed", f"{type(exc).__name__}: {exc}")

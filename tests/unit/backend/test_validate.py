"""The stream validator's failure paths, in repair and strict (debug) mode."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from dynamo.backend.adapter import EngineAdapter
from dynamo.backend.engine import chunk
from dynamo.backend.validate import StreamContractViolation, StreamValidator
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.runtime.context import Context
from tests.fakes import CountingEngine


class NoTerminal(CountingEngine):
    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        yield chunk.token(1)
        yield chunk.token(2)


class AfterTerminal(CountingEngine):
    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        yield chunk.token(1)
        yield chunk.stop()
        yield chunk.token(2)


def request() -> PreprocessedRequest:
    return PreprocessedRequest(model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=4))


async def run(adapter: EngineAdapter) -> list[LLMEngineOutput]:
    return [out async for out in adapter.generate(request(), Context())]


# -- the validator itself ----------------------------------------------------------------------
def test_repair_drops_chunks_after_the_terminal(caplog: pytest.LogCaptureFixture) -> None:
    v = StreamValidator("r1", strict=False)
    assert v.accept(chunk.token(1)) and v.accept(chunk.stop())
    with caplog.at_level(logging.ERROR):
        assert not v.accept(chunk.token(2))
    assert "r1: chunk after terminal" in caplog.text
    assert v.finish() is None and v.num_chunks == 2


def test_repair_ends_a_stream_without_terminal_with_an_error() -> None:
    v = StreamValidator("r2", strict=False)
    v.accept(chunk.token(1))
    repair = v.finish()
    assert repair is not None and repair.finish_reason is FinishReason.ERROR
    assert repair.error is not None and "without a terminal" in repair.error


def test_strict_raises_on_each_violation() -> None:
    v = StreamValidator("r3", strict=True)
    v.accept(chunk.length())
    with pytest.raises(StreamContractViolation, match="chunk after terminal"):
        v.accept(chunk.token(1))
    empty = StreamValidator("r4", strict=True)
    with pytest.raises(StreamContractViolation, match="without a terminal"):
        empty.finish()


async def test_adapter_repairs_by_default() -> None:
    outs = await run(EngineAdapter(NoTerminal()))
    assert [o.finish_reason for o in outs] == [None, None, FinishReason.ERROR]
    outs = await run(EngineAdapter(AfterTerminal()))
    assert [o.finish_reason for o in outs] == [None, FinishReason.STOP]


@pytest.mark.parametrize("engine_cls", [NoTerminal, AfterTerminal])
async def test_adapter_is_strict_when_asked(engine_cls: type[CountingEngine]) -> None:
    adapter = EngineAdapter(engine_cls(), strict=True)
    with pytest.raises(StreamContractViolation):
        await run(adapter)
    assert adapter.num_inflight == 0

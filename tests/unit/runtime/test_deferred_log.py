"""``log_later``: a record made now (time, caller, span) and written turns of the loop later,
after what the current turn queued to send."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from dynamo.observability.logging import JsonlFormatter
from dynamo.runtime.deferred_log import log_later

pytestmark = pytest.mark.unit


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonlFormatter())
    logger = logging.getLogger("dynamo.test_deferred_log")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger, out
    logger.removeHandler(handler)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


async def test_written_after_the_flush_queued_next_turn(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    loop = asyncio.get_running_loop()
    order: list[str] = []
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("failover") as span:
        made_at = sys._getframe().f_lineno + 1
        log_later(logger, logging.WARNING, "instance %x is down", 255)
    # What the same turn queues after the line (a connection's flush) goes first.
    loop.call_soon(lambda: order.append("flush"))
    assert out.getvalue() == ""
    await asyncio.sleep(0)
    order.append(f"turn 1: {len(lines(out))} lines")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    [rec] = lines(out)
    assert order[:2] == ["flush", "turn 1: 0 lines"]
    assert rec["message"] == "instance ff is down" and rec["level"] == "WARN"
    assert rec["target"] == "dynamo.test_deferred_log"
    assert rec["line"] == made_at and str(rec["file"]).endswith("test_deferred_log.py")
    # The span current when it was made labels it, though none is current when it is written.
    assert rec["trace_id"] == format(span.get_span_context().trace_id, "032x")


async def test_more_turns_and_disabled_levels(logged: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = logged
    log_later(logger, logging.DEBUG, "not enabled")
    log_later(logger, logging.INFO, "three turns", turns=3)
    for turn in range(3):
        assert out.getvalue() == "", turn
        await asyncio.sleep(0)
    assert [r["message"] for r in lines(out)] == ["three turns"]


def test_without_a_loop_it_is_written_at_once(logged: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = logged
    log_later(logger, logging.INFO, "now %d", 1)
    assert [r["message"] for r in lines(out)] == ["now 1"]

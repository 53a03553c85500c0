"""A mocker rank's load messages (``WorkerLoad``): sent when the load changed, at most every
``LOAD_INTERVAL_S`` of the engine's clock, and the load a rank settles at when it waits always
sent (at the interval's end at the latest)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from dynamo.mocker.timing import Clock
from dynamo.protocol.load import WorkerLoad

log = logging.getLogger("dynamo.mocker.engine")

LOAD_INTERVAL_S = 0.02
"""A rank's load goes out when it changed, at most this often; the load a rank settles at when
it waits always goes out (at the interval's end at the latest). Sent on every change (each
pass, each arrival to an idle rank, each return to idle), the load messages were ~15-19 % of
the mocker's samples at c=64: a ZMQ send that wakes the I/O thread costs ~30 µs of CPU, and
the frontend decodes every message. Their readers (the dashboard, a planner) want a current
view, not every pass."""

LoadSink = Callable[[WorkerLoad], Awaitable[None]]
"""Receives a rank's load when it changed, at most every ``LOAD_INTERVAL_S`` of the engine's
clock; the load it settles at when it waits (idle, or for KV transfers) always arrives."""


class LoadPublisher:
    """One rank's load messages: ``publish()`` after each pass, ``publish(settled=True)`` when
    the rank is about to wait (a load held back by the interval then goes out at the interval's
    end: one trailing task, ``flush_task``, which the engine cancels at cleanup)."""

    __slots__ = ("_sink", "_clock", "_current", "_rank", "_last", "_next_at", "flush_task")

    def __init__(
        self, sink: LoadSink, clock: Clock, current: Callable[[], WorkerLoad], rank: int
    ) -> None:
        self._sink = sink
        self._clock = clock
        self._current = current
        self._rank = rank
        self._last: WorkerLoad | None = None
        self._next_at = 0.0  # no load message before this (engine clock)
        self.flush_task: asyncio.Task[None] | None = None

    async def publish(self, *, settled: bool = False) -> None:
        now = self._clock.now()
        if now >= self._next_at:
            await self._send(now)
        elif settled and self.flush_task is None:
            self.flush_task = asyncio.create_task(
                self._send_later(self._next_at - now), name=f"mocker-load:{self._rank}"
            )

    async def _send(self, now: float) -> None:
        load = self._current()
        if load != self._last:
            self._last = load
            self._next_at = now + LOAD_INTERVAL_S
            try:
                await self._sink(load)
            except Exception:
                log.exception("load sink failed (rank %d)", self._rank)

    async def _send_later(self, delay: float) -> None:
        try:
            await self._clock.sleep(delay)
        finally:
            self.flush_task = None
        await self._send(self._clock.now())

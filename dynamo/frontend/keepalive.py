"""SSE keep-alive: a comment line on a stream that has been idle for a while.

Proxies and clients drop connections that stay silent (a long prefill, a queued request); an SSE
comment (``: keep-alive``) keeps them open and is ignored by every SSE parser.
"""

from __future__ import annotations

import asyncio

from dynamo.frontend.exchange import StreamSink
from dynamo.frontend.idle import IdleTimer

KEEP_ALIVE = b": keep-alive\n\n"


class KeepAliveSink:
    """Wraps a stream sink: after ``period_s`` seconds without a write, writes :data:`KEEP_ALIVE`
    (again every ``period_s`` while idle). ``period_s <= 0`` disables it. Call :meth:`close`
    when the response ends."""

    __slots__ = ("_sink", "_timer", "_pending")

    def __init__(self, sink: StreamSink, period_s: float) -> None:
        self._sink = sink
        self._pending: asyncio.Task[None] | None = None
        self._timer = IdleTimer(period_s, self._idle) if period_s > 0 else None
        if self._timer is not None:
            self._timer.touch()

    async def send(self, data: bytes) -> None:
        timer = self._timer
        if timer is not None:
            timer.pause()  # no comment may interleave with this write
            if self._pending is not None:
                await self._pending
                self._pending = None
        await self._sink.send(data)
        if timer is not None:
            timer.touch()

    def _idle(self) -> None:
        self._pending = asyncio.get_running_loop().create_task(self._comment())

    async def _comment(self) -> None:
        try:
            await self._sink.send(KEEP_ALIVE)
        except Exception:  # the client is gone: the next real write reports it
            return
        if self._timer is not None:
            self._timer.touch()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

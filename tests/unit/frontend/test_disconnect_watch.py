"""DisconnectWatch: a stream watches its client's connection only after waiting for the engine."""

from __future__ import annotations

import asyncio
from typing import cast

from dynamo.frontend.disconnect import DisconnectWatch
from dynamo.frontend.exchange import Exchange
from dynamo.runtime.context import Context


class _Client:
    """The part of an Exchange a watch uses: ``disconnected()``, counted."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.watches = 0

    async def disconnected(self) -> None:
        self.watches += 1
        await self.gone.wait()


async def test_a_stream_with_activity_never_asks_for_the_connection() -> None:
    client, ctx = _Client(), Context()
    watch = DisconnectWatch(cast(Exchange, client), ctx, 0.05)
    for _ in range(10):  # the engine answers every 10 ms: never idle for 50 ms
        await asyncio.sleep(0.01)
        watch.activity()
    assert client.watches == 0 and not watch.done()
    watch.cancel()
    await asyncio.sleep(0.08)  # cancelled: it never arms
    assert client.watches == 0


async def test_an_idle_stream_watches_and_a_client_that_left_stops_the_request() -> None:
    client, ctx = _Client(), Context()
    client.gone.set()  # the client left before the watch was armed
    watch = DisconnectWatch(cast(Exchange, client), ctx, 0.02)
    async with asyncio.timeout(5):
        while not ctx.is_stopped():
            await asyncio.sleep(0.005)
    assert client.watches == 1 and watch.done()
    watch.cancel()


async def test_no_delay_watches_at_once() -> None:
    client, ctx = _Client(), Context()
    watch = DisconnectWatch(cast(Exchange, client), ctx, 0.0)
    await asyncio.sleep(0)
    assert client.watches == 1 and not watch.done()
    client.gone.set()
    async with asyncio.timeout(5):
        while not watch.done():
            await asyncio.sleep(0.001)
    assert ctx.is_stopped()
    watch.cancel()

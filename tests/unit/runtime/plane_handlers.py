"""Request-plane handlers for the local and TCP plane tests, with server-side observations."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument

EP = "ns.comp.generate"


async def collect(it: AsyncIterator[bytes]) -> list[bytes]:
    """Every body of a response stream (5 s at most)."""
    async with asyncio.timeout(5):
        return [body async for body in it]


async def wait_for(predicate: object, timeout: float = 10.0) -> None:
    """Poll ``predicate()`` until it is true (``timeout`` seconds at most: generous, as it only
    bounds a failure; a loaded machine can take seconds over a few loop turns)."""
    async with asyncio.timeout(timeout):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.005)


class Recorder:
    """Server-side observations: the handler's contexts, how far it got, whether it finished."""

    def __init__(self) -> None:
        self.contexts: list[Context] = []
        self.produced = 0
        self.closed = 0

    async def count(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        """``int(body)`` bodies, letting other streams run now and then."""
        for i in range(int(body)):
            yield b"%d" % i
            if i % 7 == 0:
                await asyncio.sleep(0)

    async def until_stopped(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        """Streams until its context stops, then emits a 'cancelled' terminal (like an engine)."""
        self.contexts.append(ctx)
        try:
            while not ctx.is_stopped():
                self.produced += 1
                yield b"tok"
                await asyncio.sleep(0.005)
            yield b"killed" if ctx.is_killed() else b"cancelled"
        finally:
            self.closed += 1

    async def flood(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        """Never sleeps: only backpressure can hold it."""
        self.contexts.append(ctx)
        try:
            while not ctx.is_stopped():
                self.produced += 1
                yield b"x" * 100
        finally:
            self.closed += 1

    async def failing(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        yield b"partial"
        raise InvalidArgument("temperature must be >= 0")

    async def crashing(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        yield b"partial"
        raise ValueError("boom")

    async def not_bytes(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        yield bytearray(b"ok")  # type: ignore[misc]
        yield "text"  # type: ignore[misc]

"""A TCP request-plane server bounds its in-flight handlers: beyond, clients get Overloaded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamo.runtime.context import Context
from dynamo.runtime.errors import Overloaded
from dynamo.runtime.request_plane.tcp_client import TCPRequestPlaneClient
from dynamo.runtime.request_plane.tcp_server import TCPRequestPlaneServer


async def test_requests_beyond_the_limit_are_overloaded() -> None:
    release = asyncio.Event()

    async def slow(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        yield b"started"
        await release.wait()
        yield b"done"

    server = TCPRequestPlaneServer(max_inflight=2)
    await server.start()
    server.register("ns.c.e/1", slow)
    client = TCPRequestPlaneClient()
    try:
        held = [client.stream(server.address, "ns.c.e/1", b"", Context()) for _ in range(2)]
        for stream in held:
            assert await anext(stream) == b"started"
        with pytest.raises(Overloaded, match="in flight"):
            async for _ in client.stream(server.address, "ns.c.e/1", b"", Context()):
                pass
        release.set()
        for stream in held:
            assert [b async for b in stream] == [b"done"]
        # capacity is back once the handlers finished
        got = [b async for b in client.stream(server.address, "ns.c.e/1", b"", Context())]
        assert got == [b"started", b"done"]
    finally:
        await client.close()
        await server.stop()

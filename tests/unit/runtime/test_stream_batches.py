"""stream_batches: every body already received comes as one list; order, errors and
cancellation behave as with stream()."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument
from dynamo.runtime.request_plane.local import (
    LocalHub,
    LocalRequestPlaneClient,
    LocalRequestPlaneServer,
)
from dynamo.runtime.request_plane.tcp_client import TCPRequestPlaneClient
from dynamo.runtime.request_plane.tcp_server import TCPRequestPlaneServer

N = 100


async def handler(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
    for i in range(N):
        if ctx.is_stopped():
            return
        yield str(i).encode()
    if body == b"fail":
        raise InvalidArgument("bad tail")


@pytest.fixture(params=["local", "tcp"])
async def plane(request: pytest.FixtureRequest) -> AsyncIterator[tuple[object, str]]:
    if request.param == "local":
        hub = LocalHub()
        server: object = LocalRequestPlaneServer(hub)
        client: object = LocalRequestPlaneClient(hub)
    else:
        server = TCPRequestPlaneServer()
        client = TCPRequestPlaneClient()
    await server.start()  # type: ignore[attr-defined]
    server.register("ns.c.e/1", handler)  # type: ignore[attr-defined]
    yield client, server.address  # type: ignore[attr-defined]
    await client.close()  # type: ignore[attr-defined]
    await server.stop()  # type: ignore[attr-defined]


async def test_batches_keep_order_and_coalesce(plane: tuple[object, str]) -> None:
    client, address = plane
    stream = client.stream_batches(address, "ns.c.e/1", b"", Context())  # type: ignore[attr-defined]
    batches: list[list[bytes]] = []
    async for batch in stream:
        assert batch, "a batch is never empty"
        batches.append(batch)
        await asyncio.sleep(0.01)  # a slow consumer: bodies pile up between reads
    assert [b for batch in batches for b in batch] == [str(i).encode() for i in range(N)]
    assert max(len(b) for b in batches) > 1


async def test_batches_raise_the_typed_error_at_the_end(plane: tuple[object, str]) -> None:
    client, address = plane
    got: list[bytes] = []
    with pytest.raises(InvalidArgument, match="bad tail"):
        async for batch in client.stream_batches(address, "ns.c.e/1", b"fail", Context()):  # type: ignore[attr-defined]
            got.extend(batch)
    assert len(got) == N

"""The in-process request plane: the same contract as TCP without sockets."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from dynamo.runtime.context import Context
from dynamo.runtime.errors import (
    CannotConnect,
    InvalidArgument,
    NoInstances,
    StreamIncomplete,
    Unknown,
)
from dynamo.runtime.request_plane.local import (
    LocalHub,
    LocalRequestPlaneClient,
    LocalRequestPlaneServer,
)
from tests.unit.runtime.plane_handlers import EP, Recorder, collect, wait_for


@pytest.fixture
def hub() -> LocalHub:
    return LocalHub()


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
async def server(hub: LocalHub, rec: Recorder) -> AsyncIterator[LocalRequestPlaneServer]:
    srv = LocalRequestPlaneServer(hub)
    for name in ("count", "until_stopped", "flood", "failing", "crashing", "not_bytes"):
        srv.register(f"ns.comp.{name}", getattr(rec, name))
    srv.register(EP, rec.count)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
def client(hub: LocalHub) -> LocalRequestPlaneClient:
    return LocalRequestPlaneClient(hub)


async def test_stream_in_order(
    server: LocalRequestPlaneServer, client: LocalRequestPlaneClient
) -> None:
    assert server.address.startswith("local://")
    assert await collect(client.stream(server.address, EP, b"300", Context())) == [
        b"%d" % i for i in range(300)
    ]
    assert await collect(client.stream(server.address, EP, b"0", Context())) == []
    assert server.num_inflight() == 0
    await client.close()


async def test_typed_errors(
    server: LocalRequestPlaneServer, client: LocalRequestPlaneClient
) -> None:
    got: list[bytes] = []
    with pytest.raises(InvalidArgument, match="temperature"):
        async for body in client.stream(server.address, "ns.comp.failing", b"", Context()):
            got.append(body)
    assert got == [b"partial"]
    with pytest.raises(Unknown, match="ValueError: boom"):
        await collect(client.stream(server.address, "ns.comp.crashing", b"", Context()))
    with pytest.raises(Unknown, match="TypeError"):
        await collect(client.stream(server.address, "ns.comp.not_bytes", b"", Context()))
    with pytest.raises(NoInstances):
        await collect(client.stream(server.address, "ns.comp.nope", b"", Context()))
    with pytest.raises(CannotConnect):
        await collect(client.stream("local://nobody", EP, b"1", Context()))


async def test_unregister_keeps_in_flight_streams(
    server: LocalRequestPlaneServer, client: LocalRequestPlaneClient
) -> None:
    ctx = Context()
    async with aclosing(client.stream(server.address, "ns.comp.until_stopped", b"", ctx)) as it:
        assert await anext(it) == b"tok"
        server.unregister("ns.comp.until_stopped")
        with pytest.raises(NoInstances):
            await collect(client.stream(server.address, "ns.comp.until_stopped", b"", Context()))
        assert server.num_inflight() == 1
        ctx.stop_generating()
        assert [b async for b in it][-1] == b"cancelled"


@pytest.mark.parametrize("kill", [False, True])
async def test_cancel_mid_stream(
    server: LocalRequestPlaneServer, client: LocalRequestPlaneClient, rec: Recorder, kill: bool
) -> None:
    ctx = Context("req-7")
    got: list[bytes] = []
    async with asyncio.timeout(2):
        async for body in client.stream(server.address, "ns.comp.until_stopped", b"", ctx):
            got.append(body)
            if len(got) == 3:
                ctx.kill() if kill else ctx.stop_generating()
    assert got[-1] == (b"killed" if kill else b"cancelled")
    [server_ctx] = rec.contexts
    assert server_ctx.id == "req-7" and server_ctx is not ctx
    assert server_ctx.is_stopped() and server_ctx.is_killed() == kill


async def test_kill_after_stop_reaches_the_handler(
    server: LocalRequestPlaneServer, client: LocalRequestPlaneClient, rec: Recorder
) -> None:
    ctx = Context()
    it = client.stream(server.address, "ns.comp.until_stopped", b"", ctx)
    async with aclosing(it):
        await anext(it)
        ctx.stop_generating()
        ctx.kill()
        assert rec.contexts[0].is_killed()


async def test_early_break_and_abandon(
    server: LocalRequestPlaneServer, client: LocalRequestPlaneClient, rec: Recorder
) -> None:
    ctx = Context()
    async with aclosing(client.stream(server.address, "ns.comp.until_stopped", b"", ctx)) as it:
        async for _ in it:
            break
    await wait_for(lambda: rec.closed == 1)
    assert rec.contexts[0].is_killed() and not ctx.is_stopped()
    # dropped without aclose: the loop's async-generator finalizer closes it
    it2 = client.stream(server.address, "ns.comp.until_stopped", b"", Context())
    await anext(it2)
    del it2
    gc.collect()
    await wait_for(lambda: rec.closed == 2)
    assert rec.contexts[1].is_killed()
    await wait_for(lambda: server.num_inflight() == 0)


async def test_server_stopped_mid_stream(
    server: LocalRequestPlaneServer, client: LocalRequestPlaneClient, rec: Recorder
) -> None:
    it = client.stream(server.address, "ns.comp.until_stopped", b"", Context())
    async with aclosing(it):
        await anext(it)
        await server.stop()
        assert rec.closed == 1 and server.num_inflight() == 0
        with pytest.raises(StreamIncomplete):
            async with asyncio.timeout(2):
                async for _ in it:
                    pass
    with pytest.raises(CannotConnect):  # detached from the hub
        await collect(client.stream(server.address, EP, b"1", Context()))


async def test_thousand_concurrent_streams(
    server: LocalRequestPlaneServer, client: LocalRequestPlaneClient
) -> None:
    async def one(k: int) -> None:
        got = await collect(client.stream(server.address, EP, b"%d" % (k % 50 + 1), Context()))
        assert got == [b"%d" % i for i in range(k % 50 + 1)]

    await asyncio.gather(*(one(k) for k in range(1000)))
    assert server.num_inflight() == 0


async def test_slow_consumer_blocks_the_handler(
    hub: LocalHub, server: LocalRequestPlaneServer, rec: Recorder
) -> None:
    window = 8
    client = LocalRequestPlaneClient(hub, window=window)
    async with aclosing(client.stream(server.address, "ns.comp.flood", b"", Context())) as it:
        await anext(it)
        await asyncio.sleep(0.1)
        assert rec.produced <= window
        for taken in range(2, 100):
            await anext(it)
            assert rec.produced <= taken + window
    await wait_for(lambda: rec.closed == 1)


async def test_hub_addresses(hub: LocalHub) -> None:
    first = LocalRequestPlaneServer(hub, name="worker-1")
    await first.start()
    assert first.address == "local://worker-1" and hub.lookup(first.address) is first
    with pytest.raises(ValueError):
        await LocalRequestPlaneServer(hub, name="worker-1").start()
    await first.stop()
    await first.stop()  # idempotent
    assert hub.lookup("local://worker-1") is None
    with pytest.raises(RuntimeError):
        await first.start()
    with pytest.raises(ValueError):
        LocalRequestPlaneClient(hub, window=0)


async def test_stop_before_the_handler_ran(
    server: LocalRequestPlaneServer, client: LocalRequestPlaneClient
) -> None:
    task = asyncio.create_task(collect(client.stream(server.address, EP, b"5", Context())))
    await asyncio.sleep(0)  # the stream is opened, its handler task not yet started
    await server.stop()
    with pytest.raises(StreamIncomplete):
        await task
    assert server.num_inflight() == 0

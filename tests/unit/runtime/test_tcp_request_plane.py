"""The TCP request plane on 127.0.0.1: streams, typed errors, cancellation, pooling and
backpressure (failures and bad frames: test_tcp_request_plane_faults.py)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from dynamo.runtime import codec
from dynamo.runtime.context import Context
from dynamo.runtime.errors import (
    InvalidArgument,
    NoInstances,
    Overloaded,
    StreamIncomplete,
    Unknown,
)
from dynamo.runtime.request_plane.tcp import (
    TCPRequestPlaneClient,
    TCPRequestPlaneServer,
    parse_address,
)
from dynamo.runtime.request_plane.tcp_connection import FrameWriter
from tests.unit.runtime.plane_handlers import EP, Recorder, collect, wait_for


@pytest.fixture
async def rec() -> Recorder:
    return Recorder()


@pytest.fixture
async def server(rec: Recorder) -> AsyncIterator[TCPRequestPlaneServer]:
    srv = TCPRequestPlaneServer("127.0.0.1", 0, max_frame_size=64 * 1024)
    srv.register(EP, rec.count)
    srv.register("ns.comp.until_stopped", rec.until_stopped)
    srv.register("ns.comp.flood", rec.flood)
    srv.register("ns.comp.failing", rec.failing)
    srv.register("ns.comp.crashing", rec.crashing)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def client() -> AsyncIterator[TCPRequestPlaneClient]:
    cli = TCPRequestPlaneClient(max_frame_size=64 * 1024)
    yield cli
    await cli.close()


# -- streams and errors ---------------------------------------------------------------------
async def test_stream_in_order(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient
) -> None:
    assert server.address.startswith("tcp://127.0.0.1:")
    got = await collect(client.stream(server.address, EP, b"50", Context()))
    assert got == [b"%d" % i for i in range(50)]
    assert await collect(client.stream(server.address, EP, b"0", Context())) == []
    await wait_for(lambda: server.num_inflight() == 0)


async def test_wire_ends_with_complete_final(server: TCPRequestPlaneServer) -> None:
    reader, writer = await asyncio.open_connection(*parse_address(server.address))
    try:
        head, _ = codec.request_frame(1, codec.RequestHeader(EP, "r1", 16), b"3")
        writer.write(head + b"3")
        decoder = codec.FrameDecoder(1 << 20)
        frames: list[codec.Frame] = []
        async with asyncio.timeout(2):
            while len(frames) < 4:
                frames += decoder.feed(await reader.read(4096))
        kinds = [codec.decode_response(f[4]) for f in frames]
        assert kinds == [
            (codec.RESP_DATA, b"0"),
            (codec.RESP_DATA, b"1"),
            (codec.RESP_DATA, b"2"),
        ] + [(codec.RESP_FINAL, None)]
        assert {f[1] for f in frames} == {1}
    finally:
        writer.close()
        await writer.wait_closed()


async def test_typed_error_crosses_the_wire(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient
) -> None:
    got: list[bytes] = []
    with pytest.raises(InvalidArgument, match="temperature must be >= 0"):
        async for body in client.stream(server.address, "ns.comp.failing", b"", Context()):
            got.append(body)
    assert got == [b"partial"]
    with pytest.raises(Unknown, match="ValueError: boom"):
        await collect(client.stream(server.address, "ns.comp.crashing", b"", Context()))


@pytest.mark.parametrize("error", [Overloaded, StreamIncomplete, InvalidArgument])
async def test_each_error_kind_keeps_its_type(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, error: type[Exception]
) -> None:
    async def raising(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        raise error("why")
        yield b""  # pragma: no cover

    server.register("ns.comp.raising", raising)
    with pytest.raises(error, match="why"):
        await collect(client.stream(server.address, "ns.comp.raising", b"", Context()))


async def test_unknown_and_unregistered_endpoints(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, rec: Recorder
) -> None:
    with pytest.raises(NoInstances, match="ns.comp.nope"):
        await collect(client.stream(server.address, "ns.comp.nope", b"", Context()))
    # unregister: the in-flight stream carries on, new requests are refused
    ctx = Context()
    async with aclosing(client.stream(server.address, "ns.comp.until_stopped", b"", ctx)) as it:
        assert await anext(it) == b"tok"
        server.unregister("ns.comp.until_stopped")
        with pytest.raises(NoInstances):
            await collect(client.stream(server.address, "ns.comp.until_stopped", b"", Context()))
        assert await anext(it) == b"tok"
        ctx.stop_generating()
        rest = [body async for body in it]
    assert rest[-1] == b"cancelled"


async def test_request_id_and_binary_bodies(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient
) -> None:
    seen: list[str] = []
    blob = bytes(range(256)) * 100  # 25.6 KB, several reads

    async def echo(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        seen.append(ctx.id)
        yield body
        yield body[::-1]

    server.register("ns.comp.echo", echo)
    got = await collect(client.stream(server.address, "ns.comp.echo", blob, Context("req-42")))
    assert got == [blob, blob[::-1]] and seen == ["req-42"]


async def test_frame_size_limits_per_stream(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient
) -> None:
    async def huge(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        yield b"ok"
        yield b"h" * (128 * 1024)

    server.register("ns.comp.huge", huge)
    with pytest.raises(InvalidArgument, match="exceeds the maximum frame size"):
        await collect(client.stream(server.address, "ns.comp.huge", b"", Context()))
    with pytest.raises(InvalidArgument, match="request of"):
        await collect(client.stream(server.address, EP, b"1" * (100 * 1024), Context()))
    # neither error broke the shared connection
    assert await collect(client.stream(server.address, EP, b"2", Context())) == [b"0", b"1"]
    assert client.num_connections(server.address) == 1


# -- cancellation ---------------------------------------------------------------------------
@pytest.mark.parametrize("kill", [False, True])
async def test_cancel_mid_stream(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, rec: Recorder, kill: bool
) -> None:
    ctx = Context()
    got: list[bytes] = []
    async with asyncio.timeout(2):
        async for body in client.stream(server.address, "ns.comp.until_stopped", b"", ctx):
            got.append(body)
            if len(got) == 3:
                ctx.kill() if kill else ctx.stop_generating()
    # the stream ended normally (complete_final) with the handler's own terminal
    assert got[:3] == [b"tok"] * 3 and got[-1] == (b"killed" if kill else b"cancelled")
    [server_ctx] = rec.contexts
    assert server_ctx.is_stopped() and server_ctx.is_killed() == kill
    await wait_for(lambda: server.num_inflight() == 0)


async def test_kill_after_stop_is_forwarded(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient
) -> None:
    seen: list[Context] = []

    async def until_killed(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        seen.append(ctx)
        while not ctx.is_killed():  # a stop alone is not enough for this one
            yield b"tok"
            await asyncio.sleep(0.005)

    server.register("ns.comp.until_killed", until_killed)
    parent = Context()
    ctx = parent.child()
    it = client.stream(server.address, "ns.comp.until_killed", b"", ctx)
    async with aclosing(it):
        assert await anext(it) == b"tok"
        ctx.stop_generating()
        await wait_for(lambda: seen[0].is_stopped())
        assert not seen[0].is_killed()
        parent.kill()  # reaches the stream through the context tree
        await wait_for(lambda: seen[0].is_killed())
        async with asyncio.timeout(2):
            async for _ in it:
                pass
    assert ctx._children == []  # the stream's forwarder detached itself


async def test_context_stopped_before_the_request(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, rec: Recorder
) -> None:
    ctx = Context()
    ctx.stop_generating()
    got = await collect(client.stream(server.address, "ns.comp.until_stopped", b"", ctx))
    assert got[-1] == b"cancelled"


async def test_early_break_cancels_the_server_side(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, rec: Recorder
) -> None:
    ctx = Context()
    async with aclosing(client.stream(server.address, "ns.comp.until_stopped", b"", ctx)) as it:
        async for _ in it:
            break
    await wait_for(lambda: rec.closed == 1)
    assert rec.contexts[0].is_killed()
    assert not ctx.is_stopped()  # the caller's context is untouched
    await wait_for(lambda: server.num_inflight() == 0)
    # and the connection is still good
    assert await collect(client.stream(server.address, EP, b"2", Context())) == [b"0", b"1"]


async def test_abandoned_iterator_is_cancelled_when_collected(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, rec: Recorder
) -> None:
    it = client.stream(server.address, "ns.comp.until_stopped", b"", Context())
    assert await anext(it) == b"tok"
    del it  # no aclose: the event loop's async-generator finalizer closes it
    gc.collect()
    await wait_for(lambda: rec.closed == 1)
    assert rec.contexts[0].is_killed()


async def test_consumer_task_cancelled(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, rec: Recorder
) -> None:
    async def consume() -> None:
        async for _ in client.stream(server.address, "ns.comp.flood", b"", Context()):
            await asyncio.sleep(0.01)

    task = asyncio.create_task(consume())
    await wait_for(lambda: rec.produced > 0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: rec.closed == 1)
    assert rec.contexts[0].is_killed()


# -- scale and pooling ----------------------------------------------------------------------
async def test_thousand_concurrent_streams(server: TCPRequestPlaneServer) -> None:
    async def tagged(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        for i in range(40):
            yield body + b":%d" % i
            if i % 8 == 0:
                await asyncio.sleep(0)  # interleave streams on the wire

    server.register("ns.comp.tagged", tagged)
    client = TCPRequestPlaneClient(max_connections=4, streams_per_connection=100, window=8)
    try:

        async def one(k: int) -> None:
            tag = b"s%d" % k
            got = [b async for b in client.stream(server.address, "ns.comp.tagged", tag, Context())]
            assert got == [tag + b":%d" % i for i in range(40)]

        async with asyncio.timeout(30):
            await asyncio.gather(*(one(k) for k in range(1000)))
        assert client.num_connections(server.address) == 4
        assert server.num_inflight() == 0
    finally:
        await client.close()


# -- backpressure ---------------------------------------------------------------------------
async def test_slow_consumer_blocks_the_handler(
    server: TCPRequestPlaneServer, rec: Recorder
) -> None:
    window = 8
    client = TCPRequestPlaneClient(window=window)
    try:
        ctx = Context()
        async with aclosing(client.stream(server.address, "ns.comp.flood", b"", ctx)) as it:
            await anext(it)
            await asyncio.sleep(0.3)  # a slow consumer: the producer must stall, not run ahead
            assert rec.produced <= window + 1
            stalled_at = rec.produced
            await asyncio.sleep(0.1)
            assert rec.produced == stalled_at
            for taken in range(2, 200):
                await anext(it)
                # never more than a window ahead of what the consumer took
                assert rec.produced <= taken + window + 1
        await wait_for(lambda: rec.closed == 1)
    finally:
        await client.close()


async def test_unread_socket_pauses_the_handler(server: TCPRequestPlaneServer) -> None:
    """A client that stops reading the socket (with credit to spare) stalls the handler once the
    connection's write buffer is full: the server does not queue without bound."""
    produced = 0
    big = b"b" * 4096

    async def flood_big(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        nonlocal produced
        while not ctx.is_stopped():
            produced += 1
            yield big

    server.register("ns.comp.flood_big", flood_big)
    reader, writer = await asyncio.open_connection(*parse_address(server.address))
    try:
        header = codec.RequestHeader("ns.comp.flood_big", "r", codec.MAX_ARG)
        writer.write(codec.request_frame(1, header, b"")[0])
        await wait_for(lambda: produced > 0)
        [conn] = server._connections
        await wait_for(lambda: conn.paused)
        await asyncio.sleep(0.2)
        stalled = produced
        await asyncio.sleep(0.2)
        assert produced == stalled  # blocked on the transport, far from its 65535 credits
        assert stalled * len(big) < 64 * 1024 * 1024
    finally:
        writer.close()
        await writer.wait_closed()
    await wait_for(lambda: server.num_inflight() == 0)


# -- write coalescing ---------------------------------------------------------------------------
class _Transport:
    """Records what a connection writes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False


async def test_a_new_request_leaves_at_once_and_the_rest_of_its_iteration_coalesces() -> None:
    class Writer(FrameWriter):
        def data_received(self, data: bytes) -> None:
            pass

    writer = Writer(asyncio.get_running_loop(), 1 << 20)
    wire = _Transport()
    writer.transport = wire  # type: ignore[assignment]
    writer.write_leading(b"head1", b"body1")
    assert wire.writes == [b"head1body1"]  # sent before the sender goes on
    writer.write_leading(b"head2", b"")  # the same loop iteration: queued ...
    writer.write(b"credit")
    assert wire.writes == [b"head1body1"]
    await asyncio.sleep(0)
    assert wire.writes == [b"head1body1", b"head2credit"]  # ... and sent together at its end
    writer.write(b"credit")  # a plain frame waits for the end of its iteration
    writer.write_leading(b"head3", b"body3")
    assert wire.writes == [b"head1body1", b"head2credit"]
    await asyncio.sleep(0)
    assert wire.writes[-1] == b"credithead3body3"
    writer.write_leading(b"head4", b"body4")  # a new iteration: at once again
    assert wire.writes[-1] == b"head4body4"

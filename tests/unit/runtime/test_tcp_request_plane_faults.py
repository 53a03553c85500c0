"""The TCP request plane when things go wrong: the server stops or resets mid-stream, nothing
listens, the client closes, and garbage, truncated or oversized frames arrive."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from dynamo.runtime import codec
from dynamo.runtime.context import Context
from dynamo.runtime.errors import (
    CannotConnect,
    Disconnected,
    InvalidArgument,
    StreamIncomplete,
)
from dynamo.runtime.request_plane import tcp_client
from dynamo.runtime.request_plane.tcp import (
    TCPRequestPlaneClient,
    TCPRequestPlaneServer,
    parse_address,
)
from tests.unit.runtime.plane_handlers import EP, Recorder, collect, wait_for


@pytest.fixture
async def rec() -> Recorder:
    return Recorder()


@pytest.fixture
async def server(rec: Recorder) -> AsyncIterator[TCPRequestPlaneServer]:
    srv = TCPRequestPlaneServer("127.0.0.1", 0, max_frame_size=64 * 1024)
    srv.register(EP, rec.count)
    srv.register("ns.comp.until_stopped", rec.until_stopped)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def client() -> AsyncIterator[TCPRequestPlaneClient]:
    cli = TCPRequestPlaneClient(max_frame_size=64 * 1024)
    yield cli
    await cli.close()


async def read_frames(reader: asyncio.StreamReader) -> list[codec.Frame]:
    """Everything the server sends until it closes the connection (10 s at most)."""
    async with asyncio.timeout(10):
        data = await reader.read()
    return codec.FrameDecoder(1 << 20).feed(data)


# -- failures -------------------------------------------------------------------------------
async def test_server_stopped_mid_stream(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, rec: Recorder
) -> None:
    it = client.stream(server.address, "ns.comp.until_stopped", b"", Context())
    async with aclosing(it):
        assert await anext(it) == b"tok"
        await server.stop()
        assert rec.closed == 1 and server.num_inflight() == 0  # handlers were cancelled
        with pytest.raises(StreamIncomplete, match="before complete_final"):
            async with asyncio.timeout(2):
                async for _ in it:
                    pass
    with pytest.raises(CannotConnect):  # the listener is closed too
        await collect(client.stream(server.address, EP, b"1", Context()))
    await server.stop()  # idempotent


async def test_connection_reset_mid_stream(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, rec: Recorder
) -> None:
    it = client.stream(server.address, "ns.comp.until_stopped", b"", Context())
    async with aclosing(it):
        assert await anext(it) == b"tok"
        [conn] = server._connections
        assert conn.transport is not None
        conn.transport.abort()  # RST, as when the worker process dies with data in flight
        with pytest.raises(StreamIncomplete):
            async with asyncio.timeout(2):
                async for _ in it:
                    pass
    # the server killed the orphaned handler's context, and a new connection works
    await wait_for(lambda: rec.closed == 1)
    assert rec.contexts[0].is_killed()
    assert await collect(client.stream(server.address, EP, b"1", Context())) == [b"0"]


async def test_cannot_connect(client: TCPRequestPlaneClient) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(CannotConnect):
        await collect(client.stream(f"tcp://127.0.0.1:{port}", EP, b"1", Context()))
    with pytest.raises(InvalidArgument):
        await collect(client.stream("local://abc", EP, b"1", Context()))


async def test_client_close_fails_open_streams(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient
) -> None:
    it = client.stream(server.address, "ns.comp.until_stopped", b"", Context())
    async with aclosing(it):
        assert await anext(it) == b"tok"
        await client.close()
        with pytest.raises(Disconnected):
            async for _ in it:
                pass
    with pytest.raises(CannotConnect):
        await collect(client.stream(server.address, EP, b"1", Context()))


async def test_client_rejects_garbage_from_a_server(
    client: TCPRequestPlaneClient, caplog: pytest.LogCaptureFixture
) -> None:
    done = asyncio.Event()

    async def bogus(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(16)
        writer.write(b"this is not a frame at all")
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()
        await writer.wait_closed()
        done.set()

    fake = await asyncio.start_server(bogus, "127.0.0.1", 0)
    port = fake.sockets[0].getsockname()[1]
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(StreamIncomplete, match="bad frame"):
            await collect(client.stream(f"tcp://127.0.0.1:{port}", EP, b"1", Context()))
        assert "bad frame" in caplog.text
        async with asyncio.timeout(2):
            await done.wait()
    finally:
        fake.close()
        await fake.wait_closed()


# -- bad frames -----------------------------------------------------------------------------
async def _long_stream_survives(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, attack: bytes, close: bool
) -> list[codec.Frame]:
    ctx = Context()
    async with aclosing(client.stream(server.address, "ns.comp.until_stopped", b"", ctx)) as it:
        assert await anext(it) == b"tok"
        reader, writer = await asyncio.open_connection(*parse_address(server.address))
        try:
            writer.write(attack)
            if close:
                writer.write_eof()
            frames = await read_frames(reader)  # the server closes the bad connection
        finally:
            writer.close()
            await writer.wait_closed()
        assert await anext(it) == b"tok"  # the other connection is unaffected
        ctx.stop_generating()
        assert [b async for b in it][-1] == b"cancelled"
    assert await collect(client.stream(server.address, EP, b"2", Context())) == [b"0", b"1"]
    return frames


async def test_garbage_closes_only_that_connection(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        frames = await _long_stream_survives(server, client, b"\x00garbage" * 10, close=False)
    assert "bad frame prefix" in caplog.text
    # the server explains itself on stream 0 before closing
    [(kind, sid, _, _, body)] = frames
    what, err = codec.decode_response(body)
    assert (kind, sid, what) == (codec.RESPONSE, 0, codec.RESP_ERROR)
    assert isinstance(err, InvalidArgument)


async def test_oversized_frame_closes_only_that_connection(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = codec.PREFIX.pack(codec.MAGIC, codec.REQUEST, 0, 1, 10, 10 * 1024 * 1024)
    with caplog.at_level(logging.ERROR):
        await _long_stream_survives(server, client, prefix, close=False)
    assert "exceeds the maximum" in caplog.text


async def test_truncated_frame_closes_only_that_connection(
    server: TCPRequestPlaneServer, client: TCPRequestPlaneClient, caplog: pytest.LogCaptureFixture
) -> None:
    head, _ = codec.request_frame(1, codec.RequestHeader(EP, "r", 8), b"12345")
    with caplog.at_level(logging.ERROR):
        await _long_stream_survives(server, client, head + b"12", close=True)
    assert "truncated" in caplog.text


async def test_protocol_violations_close_the_connection(
    server: TCPRequestPlaneServer, caplog: pytest.LogCaptureFixture
) -> None:
    head, _ = codec.request_frame(1, codec.RequestHeader("ns.comp.until_stopped", "r", 8), b"")
    bad_header = codec.PREFIX.pack(codec.MAGIC, codec.REQUEST, 0, 2, 3, 0) + b"\xc1\xc1\xc1"
    for attack in (head + head, bad_header, codec.final_frame(1)):
        reader, writer = await asyncio.open_connection(*parse_address(server.address))
        try:
            writer.write(attack)
            await read_frames(reader)  # returns once the server has closed the connection
        finally:
            writer.close()
            await writer.wait_closed()
    await wait_for(lambda: server.num_inflight() == 0)


# -- hostile peers: connection limit and stalled frames --------------------------------------
async def test_connection_past_the_limit_gets_overloaded_and_close(rec: Recorder) -> None:
    srv = TCPRequestPlaneServer("127.0.0.1", 0, max_connections=2)
    srv.register(EP, rec.count)
    await srv.start()
    cli = TCPRequestPlaneClient()
    try:
        host, port = parse_address(srv.address)
        held = [await asyncio.open_connection(host, port) for _ in range(2)]
        await wait_for(lambda: len(srv._connections) == 2)
        reader, writer = await asyncio.open_connection(host, port)
        frames = await read_frames(reader)
        assert frames and frames[0][1] == 0  # stream 0: the connection's own error
        assert b"Overloaded" in frames[0][3] + frames[0][4]
        writer.close()
        for _, w in held:
            w.close()
        await wait_for(lambda: not srv._connections)
        # below the limit again: a real stream is served
        assert await collect(cli.stream(srv.address, EP, b"2", Context())) != []
    finally:
        await cli.close()
        await srv.stop()


@pytest.mark.parametrize("sent", [b"", b"\x00\x01\x02"], ids=["nothing", "half a frame"])
async def test_connection_stuck_before_a_whole_frame_is_closed(sent: bytes) -> None:
    srv = TCPRequestPlaneServer("127.0.0.1", 0, frame_timeout_s=0.2)
    await srv.start()
    try:
        host, port = parse_address(srv.address)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(sent)
        frames = await read_frames(reader)  # the server closes it (with an error frame)
        assert all(frame[1] == 0 for frame in frames)
        writer.close()
        await wait_for(lambda: not srv._connections)
    finally:
        await srv.stop()


async def test_retries_after_a_lost_connection_leave_together_before_other_work(
    rec: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Request migration: the streams of a lost connection fail together and their consumers
    # resend elsewhere in their next step. Those requests leave right after the last of them
    # (one flush per connection), not after the rest of that turn of the loop.
    servers = [TCPRequestPlaneServer("127.0.0.1", 0) for _ in range(2)]
    for srv in servers:
        srv.register(EP, rec.count)
        srv.register("ns.comp.until_stopped", rec.until_stopped)
        await srv.start()
    lost, other = servers
    client = TCPRequestPlaneClient()
    seen: list[tuple[int, int]] = []  # (requests sent to the other server, bytes still queued)
    original = tcp_client._ClientConnection.connection_lost

    writes: list[int] = []  # sizes of the writes to the other server after the loss

    class Recording:
        def __init__(self, transport: asyncio.Transport) -> None:
            self._transport = transport

        def write(self, data: bytes) -> None:
            writes.append(len(data))
            self._transport.write(data)

        def __getattr__(self, name: str) -> object:
            return getattr(self._transport, name)

    def connection_lost(conn: tcp_client._ClientConnection, exc: Exception | None) -> None:
        original(conn, exc)
        [to_other] = [c for c in client._all if c.address == other.address]
        to_other.transport = Recording(to_other.transport)  # type: ignore[arg-type, assignment]
        # Queued behind the failed streams' consumers, as other work of that turn would be.
        conn.loop.call_soon(lambda: seen.append((len(to_other.streams), len(to_other._out))))

    async def migrating(started: asyncio.Event) -> list[bytes]:
        try:
            async for _ in client.stream(lost.address, "ns.comp.until_stopped", b"", Context()):
                started.set()
        except StreamIncomplete:
            return await collect(client.stream(other.address, EP, b"2", Context()))
        raise AssertionError("the stream should have been cut")

    try:
        assert await collect(client.stream(other.address, EP, b"1", Context())) == [b"0"]
        monkeypatch.setattr(tcp_client._ClientConnection, "connection_lost", connection_lost)
        started = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(migrating(e)) for e in started]
        async with asyncio.timeout(5):
            for e in started:
                await e.wait()
        [conn] = lost._connections
        assert conn.transport is not None
        conn.transport.abort()  # as when the worker dies
        async with asyncio.timeout(5):
            results = await asyncio.gather(*tasks)
        assert results == [[b"0", b"1"]] * 3
        assert seen == [(3, 0)], "all three sent, and flushed before the next callback"
        assert len(writes) == 1, "in one write (a lone request's frame would leave at once)"
    finally:
        await client.close()
        for srv in servers:
            await srv.stop()

"""The frontend's HTTP connections (``http_front.py``, ``http_exchange.py``) over real loopback
TCP, with a small handler in place of the routes: whole and streamed (chunked) answers,
keep-alive and pipelining, HEAD, body limits (413) and deadlines (408), header limits (431), the
connection limit's 503, silent and idle connections, disconnects (a stream's write and a body
read notice them), back-pressure from a client that does not read, and handlers that fail."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import pytest

from dynamo.frontend.errors import HTTPError
from dynamo.frontend.exchange import ClientDisconnected, Exchange
from dynamo.frontend.http_front import connection_factory
from dynamo.runtime.http_limits import HttpLimits
from dynamo.runtime.http_server import HttpServer

MODES = pytest.mark.parametrize("write_behind", [False, True], ids=["transport", "write-behind"])
FAST = HttpLimits(
    max_connections=8,
    header_timeout_s=0.3,
    body_timeout_s=0.3,
    keep_alive_timeout_s=0.3,
    max_header_bytes=4096,
)
JSON = [("content-type", "application/json")]


class App:
    """Routes: /echo (the body back), /stream (``n`` chunks), /wait (until the client leaves),
    /forever (a stream writing until it fails), /silent (answers nothing), /boom (raises)."""

    def __init__(self, body_limit: int = 1000) -> None:
        self.body_limit = body_limit
        self.events: list[str] = []
        self.gone = asyncio.Event()

    async def __call__(self, http: Exchange) -> None:
        try:
            await self._route(http)
        except HTTPError as exc:
            http.reply(exc.status, JSON, json.dumps({"error": exc.message}).encode())
        except ClientDisconnected:
            self.events.append(f"disconnected {http.path}")
            self.gone.set()

    async def _route(self, http: Exchange) -> None:
        if http.path == "/echo":
            body = await http.body(self.body_limit)
            http.reply(200, [*JSON, ("x-id", http.header("x-id") or "-")], body)
        elif http.path == "/stream":
            sink = http.start_stream(200, [("content-type", "text/event-stream")])
            for i in range(int(http.header("n") or "3")):
                await sink.send(b"data: %d\n\n" % i)
                if not http.header("burst"):
                    await asyncio.sleep(0)
        elif http.path == "/wait":
            await http.disconnected()
            self.events.append("left")
            self.gone.set()
        elif http.path == "/forever":
            sink = http.start_stream(200, [("content-type", "text/event-stream")])
            chunk = b"x" * 65536
            while True:
                await sink.send(chunk)
                await asyncio.sleep(0)
        elif http.path == "/silent":
            return
        elif http.path == "/boom":
            raise RuntimeError("a handler bug")
        else:
            raise HTTPError(404, "no route")


@contextlib.asynccontextmanager
async def serving(
    app: App,
    limits: HttpLimits = FAST,
    *,
    write_behind: bool = True,
    max_backlog_bytes: int = 1 << 20,
) -> AsyncIterator[HttpServer]:
    server = HttpServer(
        None,
        "127.0.0.1",
        0,
        write_behind=write_behind,
        max_backlog_bytes=max_backlog_bytes,
        limits=limits,
        connection=connection_factory(app, 1 << 20),
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(drain_timeout_s=0.5)


async def exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data``, read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response (content-length or chunked): its head and its body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return head, body
            body += chunk[:-2]
    length = int(lower.split(b"content-length: ")[1].split(b"\r\n")[0])
    if head.startswith(b"HEAD"):
        return head, b""
    return head, await reader.readexactly(length)


@MODES
async def test_keep_alive_pipelining_and_streams(write_behind: bool) -> None:
    async with serving(App(), write_behind=write_behind) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        # three pipelined requests in one write: answered in order on one connection
        writer.write(
            b"POST /echo HTTP/1.1\r\nhost: t\r\nx-id: a\r\ncontent-length: 5\r\n\r\nhello"
            b"GET /stream HTTP/1.1\r\nhost: t\r\nn: 4\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nhost: t\r\nx-id: b\r\ntransfer-encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        head, body = await read_response(reader)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-id: a" in head
        assert body == b"hello" and b"connection: close" not in head
        head, body = await read_response(reader)
        assert b"transfer-encoding: chunked" in head and b"text/event-stream" in head
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\n"
        head, body = await read_response(reader)
        assert b"x-id: b" in head and body == b"abcde"
        # HEAD: the length of the body, not the body
        writer.write(b"HEAD /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"content-length: 0" in head
        writer.write(b"GET /nowhere HTTP/1.1\r\nhost: t\r\n\r\n")
        head, body = await read_response(reader)
        assert head.startswith(b"HTTP/1.1 404 Not Found") and json.loads(body)["error"]
        writer.close()


async def test_http10_is_answered_and_closed() -> None:
    async with serving(App()) as server:
        answer = await exchange(server.port, b"GET /stream HTTP/1.0\r\nn: 2\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"chunked" not in head and b"connection: close" in head
        assert body == b"data: 0\n\ndata: 1\n\n"


@MODES
async def test_body_limits_and_deadline(write_behind: bool) -> None:
    async with serving(App(body_limit=10), write_behind=write_behind) as server:
        port = server.port
        # declared over the limit: 413 at once, then the connection closes
        answer = await exchange(
            port, b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 11\r\n\r\nhello world"
        )
        assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer
        # chunked, passing the limit on the way
        answer = await exchange(
            port,
            b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            b"6\r\nabcdef\r\n6\r\nghijkl\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 413")
        # a body that never ends: 408 after the body timeout
        answer = await exchange(
            port, b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\nhe"
        )
        assert answer.startswith(b"HTTP/1.1 408")


async def test_header_limits_timeouts_and_silent_connections() -> None:
    async with serving(App()) as server:
        port = server.port
        big = b"GET /echo HTTP/1.1\r\nx-big: " + b"a" * 5000 + b"\r\n\r\n"
        answer = await exchange(port, big)
        assert answer.startswith(b"HTTP/1.1 431")
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"]
        # a head that never ends: 408 after the header timeout
        answer = await exchange(port, b"GET /echo HTTP/1.1\r\nhost: t\r\n")
        assert answer.startswith(b"HTTP/1.1 408")
        # a connection that sends nothing, and one idle after a request: closed, no answer
        assert await exchange(port, b"") == b""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\nok")
        await read_response(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        # malformed
        assert (await exchange(port, b"NOT HTTP AT ALL\r\n\r\n")).startswith(b"HTTP/1.1 400")


async def test_connections_past_the_limit_get_an_openai_503() -> None:
    limits = HttpLimits(max_connections=2, header_timeout_s=5, keep_alive_timeout_s=5)
    async with serving(App(), limits) as server:
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        await asyncio.sleep(0.1)
        answer = await exchange(server.port, b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: " in head
        assert b"connection: close" in head
        assert json.loads(body)["error"]["type"] == "service_unavailable"
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.1)
        request = b"GET /stream HTTP/1.1\r\nhost: t\r\nn: 1\r\nconnection: close\r\n\r\n"
        answer = await exchange(server.port, request)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"0\r\n\r\n")


@MODES
async def test_disconnects_reach_the_handler(write_behind: bool) -> None:
    app = App()
    async with serving(app, write_behind=write_behind) as server:
        # a handler waiting on disconnected(): the client closes
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /wait HTTP/1.1\r\nhost: t\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await asyncio.wait_for(app.gone.wait(), 5)
        assert app.events == ["left"]
        # a half-close in the middle of a body: the body read raises ClientDisconnected
        app.gone.clear()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 9\r\n\r\nabc")
        sock.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(app.gone.wait(), 5)
        assert app.events[-1] == "disconnected /echo"
        sock.close()


@MODES
async def test_a_client_that_does_not_read_is_bounded(write_behind: bool) -> None:
    """A stream to a client that never reads: the bytes held for it stay bounded (the transport
    waits for it, or the write-behind thread drops it), and another client is served meanwhile."""
    app = App()
    async with serving(app, write_behind=write_behind, max_backlog_bytes=1 << 20) as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /forever HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.sleep(0.3)
        # served meanwhile (the deadline is only for a hang: a loaded machine is slow)
        answer = await exchange(server.port, b"GET /stream HTTP/1.1\r\nhost: t\r\nn: 1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200")
        if write_behind:  # dropped once its backlog passed the cap: the stream's write fails
            await asyncio.wait_for(app.gone.wait(), 5)
            # the sender thread counts the drop just after its shutdown, which the handler may
            # see first
            async with asyncio.timeout(5):
                while server.dropped_connections == 0:
                    await asyncio.sleep(0.005)
            assert server.dropped_connections == 1
        else:  # the handler waits on the transport: nothing piles up
            assert not app.gone.is_set()
            sock.close()
            await asyncio.wait_for(app.gone.wait(), 5)
        sock.close()
        assert app.events == ["disconnected /forever"]


async def test_failing_and_silent_handlers_get_500() -> None:
    async with serving(App()) as server:
        for path in (b"/silent", b"/boom"):
            answer = await exchange(server.port, b"GET %s HTTP/1.1\r\nhost: t\r\n\r\n" % path)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 500") and b"connection: close" in head
            assert "Traceback" not in body.decode() and json.loads(body)["error"]


async def test_the_writes_of_one_iteration_leave_in_one_send() -> None:
    """A response written in one loop iteration (head, chunks, end) is one send of the
    write-behind thread (each send on loopback runs the client's receive path)."""
    async with serving(App()) as server:
        write_behind = server._write_behind
        assert write_behind is not None
        sends: list[bytes] = []
        real = write_behind.sender_send

        def counting(fd: int, data: bytes) -> None:
            sends.append(bytes(data))
            real(fd, data)

        write_behind.sender_send = counting
        request = (
            b"GET /stream HTTP/1.1\r\nhost: t\r\nn: 5\r\nburst: 1\r\nconnection: close\r\n\r\n"
        )
        answer = await exchange(server.port, request)
        assert answer.endswith(b"data: 4\n\n\r\n0\r\n\r\n")
        assert len(sends) == 1 and sends[0] == answer


async def test_trailer_fields_are_not_merged_into_the_headers() -> None:
    """A chunked body's trailer (RFC 9110 6.5.1) does not add to, or change, the request's
    headers the handler reads after the body."""
    async with serving(App()) as server:
        request = (
            b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\nconnection: close\r\n"
            b"\r\n2\r\nhi\r\n0\r\nx-id: smuggled\r\n\r\n"
        )
        answer = await exchange(server.port, request)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and body == b"hi"
        assert b"x-id: -\r\n" in head


class _FailingStream(App):
    async def _route(self, http: Exchange) -> None:
        if http.path == "/stream-boom":
            sink = http.start_stream(200, [("content-type", "text/event-stream")])
            await sink.send(b"data: 0\n\n")
            raise RuntimeError("a handler bug mid-stream")
        await super()._route(http)


async def test_a_stream_whose_handler_fails_is_cut_short_not_ended(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No last chunk after a failure: the client sees the body unterminated and the close."""
    async with serving(_FailingStream()) as server:
        answer = await exchange(server.port, b"GET /stream-boom HTTP/1.1\r\nhost: t\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"data: 0\n\n\r\n")
    assert not answer.endswith(b"0\r\n\r\n")
    assert any("HTTP handler failed" in r.getMessage() for r in caplog.records)

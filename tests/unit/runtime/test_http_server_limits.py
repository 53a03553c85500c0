"""The small HTTP server against hostile clients, over real loopback TCP: connection limit with a
clear 503, header/body/keep-alive timeouts (408 or close), header size limit (431), and a flood
of idle connections that does not stop a real request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import resource
import socket
import time
from collections.abc import AsyncIterator

import pytest

from dynamo.runtime.http_limits import HttpLimits, raise_fd_limit
from dynamo.runtime.http_server import HttpServer

MODES = pytest.mark.parametrize("write_behind", [False, True], ids=["transport", "write-behind"])
FAST = HttpLimits(
    max_connections=8,
    header_timeout_s=0.3,
    body_timeout_s=0.3,
    keep_alive_timeout_s=0.3,
    max_header_bytes=4096,
)
GET = b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"


class OkApp:
    def __init__(self) -> None:
        self.calls = 0

    def handle(
        self, method: bytes, path: bytes, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes]:
        self.calls += 1
        return 200, b'{"n":%d}' % len(body)


@contextlib.asynccontextmanager
async def serving(
    app: OkApp, limits: HttpLimits, *, write_behind: bool = False
) -> AsyncIterator[HttpServer]:
    server = HttpServer(app, "127.0.0.1", 0, write_behind=write_behind, limits=limits)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(drain_timeout_s=0.5)


async def read_all(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything until the server closes the connection."""
    return await asyncio.wait_for(reader.read(), timeout)


@MODES
async def test_connection_past_the_limit_gets_503_and_close(write_behind: bool) -> None:
    app = OkApp()
    # the held connections must outlast the test's steps: FAST's 0.3 s header timeout would
    # free their places (and end held[0]) on a loaded machine before the 9th connects
    limits = dataclasses.replace(FAST, header_timeout_s=5.0, keep_alive_timeout_s=5.0)
    async with serving(app, limits, write_behind=write_behind) as server:
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8)]
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        answer = await read_all(reader)
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert b"too many connections" in answer
        writer.close()
        # a held connection still works
        r, w = held[0]
        w.write(GET)
        assert (await asyncio.wait_for(r.readuntil(b"}"), 5)).startswith(b"HTTP/1.1 200")
        for _, w in held:
            w.close()


@MODES
async def test_incomplete_headers_time_out_with_408(write_behind: bool) -> None:
    async with serving(OkApp(), FAST, write_behind=write_behind) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /x HTTP/1.1\r\nhost: t\r\n")  # never ends its headers
        answer = await read_all(reader)
        assert answer.startswith(b"HTTP/1.1 408 ")
        writer.close()


@MODES
@pytest.mark.parametrize(
    "head",
    [
        b"POST /x HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{",
        b"POST /x HTTP/1.1\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n1\r\n{\r\n",
    ],
    ids=["content-length", "chunked"],
)
async def test_slow_body_times_out_with_408(write_behind: bool, head: bytes) -> None:
    app = OkApp()
    async with serving(app, FAST, write_behind=write_behind) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(head)
        answer = await read_all(reader)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert app.calls == 0
        writer.close()


@MODES
async def test_idle_keep_alive_connection_is_closed(write_behind: bool) -> None:
    async with serving(OkApp(), FAST, write_behind=write_behind) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GET)
        first = await asyncio.wait_for(reader.readuntil(b"}"), 5)
        assert first.startswith(b"HTTP/1.1 200")
        assert await read_all(reader) == b""  # closed, with nothing more to say
        writer.close()


async def test_oversized_headers_get_431() -> None:
    async with serving(OkApp(), FAST) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /x HTTP/1.1\r\n" + b"x-pad: " + b"a" * 5000 + b"\r\n\r\n")
        assert (await read_all(reader)).startswith(b"HTTP/1.1 431 ")
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n")
        assert (await read_all(reader)).startswith(b"HTTP/1.1 431 ")
        writer.close()


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


async def test_idle_connection_flood_does_not_stop_a_request() -> None:
    """1024 idle sockets (the reproducer), default limits: a request still answers at once."""
    if raise_fd_limit(4096) < 2200:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        pytest.fail(f"cannot raise the fd limit enough (soft {soft}, hard {hard})")
    app = OkApp()
    async with serving(app, HttpLimits(), write_behind=True) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(1024)]
        try:
            started = time.monotonic()
            answer = await asyncio.to_thread(_get, server.port)
            assert answer.startswith(b"HTTP/1.1 200")
            assert time.monotonic() - started < 5.0  # generous: would hang without limits
        finally:
            for sock in idle:
                sock.close()

"""A lean HTTP/1.1 client for OpenAI-compatible servers: keep-alive connections, chunked
transfer decoding and SSE event splitting inside one ``asyncio.Protocol``.

Why not httpx: a load generator on the same small machine as the server must cost far less CPU
than the server per request. httpx spends ~25 µs of Python per SSE chunk (an async iterator, a
future and a decoder pass per chunk); this protocol parses every chunk that arrives in one
``data_received`` call inline and hands complete SSE events to a synchronous sink, with one
future per request. Measured numbers are in the module docstring of ``benchmarks/stack.py``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Protocol, cast
from urllib.parse import urlsplit

_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _LENGTH, _EOF, _IDLE = range(8)
_MAX_HEAD = 64 * 1024


class EventSink(Protocol):
    """Receives the SSE events of one streaming response, in order, synchronously.

    ``event`` is the ``event:`` field (None when absent), ``data`` the joined ``data:`` lines,
    ``now`` the ``time.perf_counter()`` of the read that completed the event. Events with
    neither data nor a name (comments, keep-alives) are not delivered.
    """

    def on_event(self, event: bytes | None, data: bytes, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the server is: ``http(s)://host:port`` plus an optional path prefix (no ``/v1``)."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        """Accepts ``http://h:p``, ``http://h:p/``, ``http://h:p/v1``; raises ValueError."""
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise ValueError(f"bad port in URL {url!r}") from exc
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[: -len("/v1")]
        return cls(parts.scheme, parts.hostname, port, prefix)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}"

    def path(self, api_path: str) -> str:
        """``/v1/...`` under this endpoint's prefix."""
        return self.prefix + api_path


@dataclass(slots=True)
class Response:
    """A finished response. ``body`` is empty when the events went to a sink."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    streamed: bool = False

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()


class StaleConnection(ConnectionError):
    """A reused keep-alive connection closed before any response byte: safe to retry."""


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buf = b""
        self._state = _IDLE
        self._remaining = 0
        self._waiter: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._sink: EventSink | None = None
        self._sse = b""
        self._streamed = False
        self._body = bytearray()
        self._keep_alive = True
        self._got_bytes = False
        self.closed = False
        self.used = 0

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._got_bytes = True
        if self._buf:
            data = self._buf + data
        try:
            self._buf = self._parse(data, now)
        except ValueError as exc:
            self._buf = b""
            self._fail(ConnectionError(f"malformed HTTP response: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost finishes or fails the response

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._state == _EOF and self._response is not None:
            self._finish()
            return
        if self._waiter is not None and not self._waiter.done():
            if not self._got_bytes and self.used > 1:
                self._fail(StaleConnection("keep-alive connection closed by the server"))
            else:
                reason = f": {exc}" if exc else ""
                self._fail(ConnectionError(f"server closed the connection mid-response{reason}"))

    # -- requests --------------------------------------------------------------------------
    async def request(self, head: bytes, body: bytes, sink: EventSink | None) -> Response:
        if self.closed or self._transport is None or self._state != _IDLE:
            raise StaleConnection("connection not usable")
        self.used += 1
        self._got_bytes = False
        self._sink = sink
        self._state = _HEAD
        self._keep_alive = True
        waiter: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        self._transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self._transport.write(body)
        return await waiter

    def abort(self) -> None:
        """Drop the connection now (timeouts, errors); a pending request fails."""
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    @property
    def reusable(self) -> bool:
        return not self.closed and self._keep_alive and self._state == _IDLE

    # -- parsing ---------------------------------------------------------------------------
    def _parse(self, data: bytes, now: float) -> bytes:
        """Consume ``data``; returns the bytes that wait for more (an incomplete line)."""
        pos = 0
        size = len(data)
        while pos < size:
            state = self._state
            if state == _CHUNK_SIZE:
                end = data.find(b"\r\n", pos)
                if end < 0:
                    break
                length = int(data[pos:end].split(b";", 1)[0], 16)
                pos = end + 2
                if length == 0:
                    self._state = _TRAILER
                elif pos + length + 2 <= size:  # the common case: the whole chunk is here
                    self._body_bytes(data[pos : pos + length], now)
                    pos += length + 2
                else:
                    self._remaining = length
                    self._state = _CHUNK_DATA
            elif state == _CHUNK_DATA or state == _LENGTH:
                take = min(self._remaining, size - pos)
                self._body_bytes(data[pos : pos + take], now)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    if state == _LENGTH:
                        self._finish()
                    else:
                        self._state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if size - pos < 2:
                    break
                pos += 2
                self._state = _CHUNK_SIZE
            elif state == _HEAD:
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    if size - pos > _MAX_HEAD:
                        raise ValueError("response head too large")
                    break
                self._start_response(data[pos:end])
                pos = end + 4
            elif state == _TRAILER:  # trailer lines up to an empty line
                end = data.find(b"\r\n", pos)
                if end < 0:
                    break
                empty = end == pos
                pos = end + 2
                if empty:
                    self._finish()
            elif state == _EOF:
                self._body_bytes(data[pos:], now)
                pos = size
            else:  # bytes while idle: the server is not speaking HTTP/1.1 request/response
                raise ValueError("unexpected bytes between responses")
        return data[pos:] if pos < size else b""

    def _start_response(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/"):
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        status = int(status_line[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        response = Response(status, headers)
        self._response = response
        connection = headers.get("connection", "").lower()
        self._keep_alive = status_line[0] == "HTTP/1.1" and "close" not in connection
        response.streamed = (
            self._sink is not None
            and status == 200
            and response.content_type == "text/event-stream"
        )
        self._streamed = response.streamed
        self._sse = b""
        self._body.clear()
        if status in (204, 304) or 100 <= status < 200:
            self._finish()
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            self._remaining = int(headers["content-length"])
            self._state = _LENGTH
            if self._remaining == 0:
                self._finish()
        else:
            self._keep_alive = False
            self._state = _EOF

    def _body_bytes(self, data: bytes, now: float) -> None:
        if not self._streamed:
            self._body += data
            return
        sink = self._sink
        assert sink is not None
        sse = self._sse
        if not sse and data.startswith(b"data: ") and data.find(b"\n") == len(data) - 2:
            if data.endswith(b"\n\n"):  # the common case: one whole one-line event
                sink.on_event(None, data[6:-2], now)
                return
        sse += data
        if b"\r" in sse:
            sse = sse.replace(b"\r\n", b"\n")
        start = 0
        while True:
            end = sse.find(b"\n\n", start)
            if end < 0:
                break
            block = sse[start:end]
            start = end + 2
            if block.startswith(b"data: ") and b"\n" not in block:
                sink.on_event(None, block[6:], now)
            else:
                _dispatch(block, sink, now)
        self._sse = sse[start:] if start else sse

    def _finish(self) -> None:
        response = self._response
        self._state = _IDLE
        self._response = None
        self._sink = None
        self._streamed = False
        if response is not None:
            response.body = bytes(self._body)
            self._body.clear()
        if not self._keep_alive:
            self.closed = True
            if self._transport is not None:
                self._transport.close()
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done() and response is not None:
            waiter.set_result(response)

    def _fail(self, exc: Exception) -> None:
        self._state = _IDLE
        self._keep_alive = False
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


def _dispatch(block: bytes, sink: EventSink, now: float) -> None:
    """The general SSE event: several lines, ``event:``, comments, multi-line data.
    ``event: X`` with only comment lines (how Dynamo sends annotations) delivers the comments."""
    event: bytes | None = None
    data: list[bytes] = []
    comments: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        elif line.startswith(b"event:"):
            event = line[6:].strip()
        elif line.startswith(b":"):
            comments.append(line[1:].strip())
    if data:
        sink.on_event(event, b"\n".join(data), now)
    elif event is not None:  # a named event with comment lines only (Dynamo's annotations)
        sink.on_event(event, b"\n".join(comments), now)


class HttpClient:
    """A pool of keep-alive connections to one endpoint. Not thread-safe; one event loop.

    ``request`` takes an idle connection (or opens one), sends the request and returns the
    finished :class:`Response`; SSE responses go to ``sink`` as they arrive. A timeout aborts
    the connection and raises TimeoutError; connection failures raise OSError subclasses.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        headers: dict[str, str] | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self.endpoint = endpoint
        self._connect_timeout = connect_timeout
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        host = endpoint.host if ":" not in endpoint.host else f"[{endpoint.host}]"
        self._common = f"Host: {host}:{endpoint.port}\r\nUser-Agent: dynamo-bench\r\n{extra}"
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if endpoint.scheme == "https" else None
        )
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    async def request(
        self,
        method: str,
        api_path: str,
        body: bytes = b"",
        *,
        sink: EventSink | None = None,
        timeout: float | None = None,
    ) -> Response:
        path = self.endpoint.path(api_path)
        head = f"{method} {path} HTTP/1.1\r\n{self._common}"
        if body or method == "POST":
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        if sink is not None:
            head += "Accept: text/event-stream\r\n"
        head_bytes = (head + "\r\n").encode("latin-1")
        for attempt in range(2):
            conn = await self._acquire()
            timer = None
            timed_out = False
            if timeout is not None:

                def expire(conn: _Connection = conn) -> None:
                    nonlocal timed_out
                    timed_out = True
                    conn.abort()

                timer = asyncio.get_running_loop().call_later(timeout, expire)
            try:
                response = await conn.request(head_bytes, body, sink)
            except StaleConnection:
                self._drop(conn)
                if attempt == 0:
                    continue
                raise
            except ConnectionError as exc:
                self._drop(conn)
                if timed_out:
                    raise TimeoutError(f"no complete response within {timeout} s") from exc
                raise
            except BaseException:
                conn.abort()
                self._drop(conn)
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            if conn.reusable:
                self._idle.append(conn)
            else:
                self._drop(conn)
            return response
        raise AssertionError("unreachable")

    async def _acquire(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable:
                return conn
            self._drop(conn)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout):
            _, conn = await loop.create_connection(
                _Connection,
                self.endpoint.host,
                self.endpoint.port,
                ssl=self._ssl,
            )
        self._all.add(conn)
        return conn

    def _drop(self, conn: _Connection) -> None:
        if not conn.closed:
            conn.abort()
        self._all.discard(conn)

    async def aclose(self) -> None:
        """Close every connection (idle and busy)."""
        for conn in list(self._all):
            conn.abort()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost

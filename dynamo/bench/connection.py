"""One HTTP/1.1 keep-alive connection as an ``asyncio.Protocol``: it parses the response
(status, headers, chunked / content-length / close-delimited bodies) and splits SSE events
inside ``data_received``, handing complete events to a synchronous sink, so a streamed
response costs one future per request rather than one per chunk.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Protocol, cast

_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _LENGTH, _EOF, _IDLE = range(8)
_MAX_HEAD = 64 * 1024


class EventSink(Protocol):
    """Receives the SSE events of one streaming response, in order, synchronously.

    ``event`` is the ``event:`` field (None when absent), ``data`` the joined ``data:`` lines,
    ``now`` the ``time.perf_counter()`` of the read that completed the event. A named event
    with only comment lines (how Dynamo sends annotations) carries the comments as ``data``.
    Comments alone (keep-alives) are not delivered.
    """

    def on_event(self, event: bytes | None, data: bytes, now: float) -> None: ...


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


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time.

    ``request`` writes a request and waits for the whole response; a streamed (SSE, status
    200) response's events go to the sink as they arrive. ``reusable`` says whether another
    request may follow; ``abort`` drops the connection and fails a pending request.
    """

    def __init__(self, quickack: bool = False) -> None:
        # TCP_QUICKACK (Linux): acknowledge every segment at once. Linux leaves quick-ack mode
        # on its own, so it is set again after every read. Without it a client's delayed ACK can
        # hold back a server's next write (Nagle) and add tens of milliseconds to latencies.
        self._quickack = quickack and hasattr(socket, "TCP_QUICKACK")
        self._sock: socket.socket | None = None
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
        self._aborted = False
        self.closed = False
        self.used = 0

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._quickack:
                self._sock = sock
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._sock is not None:
            try:
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            except OSError:
                self._sock = None
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
            if not self._got_bytes and self.used > 1 and not self._aborted:
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
        self._aborted = True
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

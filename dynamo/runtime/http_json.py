"""The JSON servers' connection (``HttpProtocol``) of the small HTTP server (``http_server.py``):
the slot tracker and the workers' status servers.

Handlers are synchronous and run inside the protocol callback: a request costs no task, no
thread hop and no copy beyond the body. With a trivial handler on the 2-core CI VM this served
~3.5x the requests/s of granian's RSGI interface (about 70k vs 20k req/s, wrk, 16 connections).

Plain requests take the native path (``_http.c``, when built and ``DYN_NATIVE`` allows): one C
call per read parses them, calls the app (or its ``fast_routes``) and renders the answers. The
rest of a read, from the first request that is not plain (chunked, Expect, HEAD, oversized,
malformed, incomplete...), goes to httptools, which keeps every limit and error answer; the
connection returns to the native path once httptools has finished that request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import httptools

from dynamo import native
from dynamo.runtime.http_connection import (
    BODY,
    CONTINUE,
    HEAD,
    IDLE,
    LINGER_S,
    ParseAbort,
    write_behind_fd,
)
from dynamo.runtime.http_limits import HttpLimits
from dynamo.runtime.http_render import JSON_TYPE, PREFIXES, render, render_keep_alive
from dynamo.runtime.write_behind import WriteBehind

if TYPE_CHECKING:
    from dynamo.runtime._http import Dispatcher

log = logging.getLogger(__name__)
_now = time.monotonic
_native_http = native.load_optional("dynamo.runtime._http")
"""The native request path (``_http.c``), or None: then httptools parses every request."""

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # Axum's default JSON body limit
_TOO_LARGE = b'{"error":"Failed to buffer the request body: length limit exceeded"}'
_MALFORMED = b'{"error":"malformed HTTP request"}'
_HEADERS_TOO_LARGE = b'{"error":"request headers too large"}'
_TIMED_OUT = b'{"error":"request not received in time"}'
_BUSY = b'{"error":"too many connections"}'
_INTERNAL = b'{"error":"internal error"}'
_IDLE, _HEAD, _BODY = IDLE, HEAD, BODY


class App(Protocol):
    """What the server calls for each complete request.

    ``handle(method, path, query, content_type, body)`` returns ``(status, body)``: a JSON body
    (sent as application/json) or ``b""`` (no content), or ``(status, body, content_type)`` for
    another media type. ``HEAD`` is passed as ``GET``; the server drops the body. Must not raise.

    An app may also have ``fast_routes`` (see ``FastRoutes``): the native request path tries
    them first for a POST whose body was sent as exactly ``application/json``.
    """

    def handle(
        self, method: bytes, path: bytes, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes] | tuple[int, bytes, bytes]: ...


FastRoutes = dict[bytes, Callable[[bytes], bytes | None]]
"""POST path -> ``route(body)``: the 200 JSON answer, or None to let ``App.handle`` answer (an
error, or anything the route does not take). Must not raise; used only by the native path, so
``handle`` must answer the same requests identically."""


def native_path(app: App, limits: HttpLimits, max_body_bytes: int) -> Dispatcher | None:
    """The native request path for ``app`` (shared by a server's connections), or None when
    ``_http`` is not built or ``DYN_NATIVE`` is off."""
    if _native_http is None:
        return None
    routes: FastRoutes = dict(getattr(app, "fast_routes", None) or {})
    dispatcher: Dispatcher = _native_http.Dispatcher(
        app.handle, render_keep_alive, PREFIXES, routes, limits.max_header_bytes, max_body_bytes
    )
    return dispatcher


class HttpProtocol(asyncio.Protocol):
    """One client connection: parse, call the app, write the response, keep alive or close."""

    __slots__ = (
        "_accepting",
        "_app",
        "_native",
        "_limit",
        "_limit_digits",
        "_connections",
        "_write_behind",
        "_fd",
        "_transport",
        "_parser",
        "_url",
        "_content_type",
        "_body",
        "_body_len",
        "_expect_continue",
        "_closing",
        "_max_header_bytes",
        "_max_connections",
        "_head_bytes",
        "state",
        "since",
    )

    def __init__(
        self,
        app: App,
        max_body_bytes: int,
        connections: set[HttpProtocol],
        write_behind: WriteBehind | None = None,
        accepting: Callable[[], bool] | None = None,
        limits: HttpLimits | None = None,
        native_path: Dispatcher | None = None,
    ) -> None:
        limits = limits or HttpLimits()
        self._native = native_path  # an _http.Dispatcher, or None
        self._max_header_bytes = limits.max_header_bytes
        self._max_connections = limits.max_connections
        self._head_bytes = 0
        # Read by the server's timeout sweep (HttpServer._sweep); written on state changes only.
        self.state = _IDLE
        self.since = _now()
        self._accepting = accepting
        self._app = app
        self._limit = max_body_bytes
        self._limit_digits = len(str(max_body_bytes))
        self._connections = connections
        self._write_behind = write_behind
        self._fd = -1  # the write-behind thread's dup of the socket, while it has one
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._content_type: bytes | None = None
        self._body: list[bytes] = []
        self._body_len = 0
        self._expect_continue = False
        self._closing = False

    # ------------------------------------------------------------ asyncio side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        if self._accepting is not None and not self._accepting():
            # Accepted by the loop while the server stopped: end it rather than leave it open.
            self._closing = True
            self._transport.close()
            return
        if len(self._connections) >= self._max_connections:
            # Past the connection limit: a clear answer and a close, not a hang.
            self._closing = True
            self._transport.write(render(503, _BUSY, close=True))
            self._transport.close()
            return
        self._fd = write_behind_fd(transport, self._write_behind)
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self._transport = None
        self._closing = True
        self.release_fd()

    def release_fd(self) -> None:
        """Hand the dup'ed socket back to the write-behind thread for closing (after its bytes)."""
        if self._fd >= 0 and self._write_behind is not None:
            self._write_behind.close(self._fd)
            self._fd = -1

    def _write(self, data: bytes) -> None:
        if self._fd >= 0 and self._write_behind is not None:
            self._write_behind.send(self._fd, data)
        elif self._transport is not None:
            self._transport.write(data)

    def _send(self, data: bytes) -> None:
        """``_write`` for answers: the sender is flushed once per loop iteration, not per call."""
        write_behind = self._write_behind
        if write_behind is not None and self._fd >= 0:
            write_behind.sender_send(self._fd, data)
            if not write_behind.scheduled:
                write_behind.schedule_flush()
        elif self._transport is not None:
            self._transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        dispatcher = self._native
        if dispatcher is not None and self.state == _IDLE:  # httptools holds no partial request
            out, used, error = dispatcher.feed(data)
            if out is not None:
                self._send(out)
            if error is not None:
                log.error("HTTP handler failed", exc_info=error)
                self._fail(500, _INTERNAL)
                return
            if used:
                self.since = _now()
                if used == len(data):
                    return
                data = data[used:]
        if self.state == _IDLE:
            self.state = _HEAD
            self.since = _now()
        try:
            self._parser.feed_data(data)
        except ParseAbort:
            pass
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, ParseAbort):
                log.exception("HTTP callback failed")
                self._fail(500, _INTERNAL)
        except httptools.HttpParserUpgrade:
            self._fail(400, b'{"error":"protocol upgrades are not supported"}')
        except httptools.HttpParserError:
            self._fail(400, _MALFORMED)

    def pause_writing(self) -> None:  # the client is not reading: stop reading its requests
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def expire(self) -> None:
        """Called by the server's sweep when the current state outlived its timeout: a request
        cut short gets 408; an idle keep-alive connection is just closed."""
        if self.state == _IDLE:
            self.close()
            self.release_fd()
        else:
            self._fail(408, _TIMED_OUT)

    def _fail(self, status: int, body: bytes, *, linger: bool = False) -> None:
        """Answer with an error and end the connection.

        ``linger``: the client may still be sending (an oversized body), so half-close and
        discard its input for a moment instead of resetting it before it reads the answer.
        """
        transport = self._transport
        if transport is None or self._closing:
            return
        self._write(render(status, body, close=True))
        self._closing = True  # data_received now discards
        if linger and self._fd >= 0 and self._write_behind is not None:
            self._write_behind.shutdown_write(self._fd)
            asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        elif linger and transport.can_write_eof():
            transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        else:
            transport.close()

    # ------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        # Marks httptools as holding a partial request: the native path waits until it ends.
        if self.state == _IDLE:
            self.state = _HEAD
            self.since = _now()

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._max_header_bytes:
            self._fail(431, _HEADERS_TOO_LARGE)
            raise ParseAbort

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name)
        self._head_bytes += size + len(value)
        if self._head_bytes > self._max_header_bytes:
            self._fail(431, _HEADERS_TOO_LARGE)
            raise ParseAbort
        if size == 12 and name.lower() == b"content-type":
            self._content_type = value
        elif size == 14 and name.lower() == b"content-length":
            # llhttp has validated the value; only ones as long as the limit can exceed it.
            if len(value) >= self._limit_digits and int(value) > self._limit:
                self._fail(413, _TOO_LARGE, linger=True)
                raise ParseAbort
        elif size == 6 and name.lower() == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True  # answered once every header is known (length checked)

    def on_headers_complete(self) -> None:
        self.state = _BODY
        self.since = _now()
        if self._expect_continue:
            self._expect_continue = False
            self._write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._limit:
            self._fail(413, _TOO_LARGE, linger=True)
            raise ParseAbort
        self._body.append(body)

    def on_message_complete(self) -> None:
        transport = self._transport
        if transport is None or self._closing:
            return
        parser = self._parser
        method = parser.get_method()
        body_parts = self._body
        if not body_parts:
            body = b""
        elif len(body_parts) == 1:
            body = body_parts[0]
        else:
            body = b"".join(body_parts)
        body_parts.clear()
        path, _, query = self._url.partition(b"?")
        content_type = self._content_type
        # Reset for the next request on this connection (no on_message_begin: one call less).
        self._url = b""
        self._content_type = None
        self._body_len = 0
        self._head_bytes = 0
        self.state = _IDLE
        self.since = _now()
        head = method == b"HEAD"
        result = self._app.handle(b"GET" if head else method, path, query, content_type, body)
        keep_alive = parser.should_keep_alive()
        status, payload = result[0], result[1]
        if keep_alive and payload and not head and len(result) == 2 and status in PREFIXES:
            # The hot path, keep-alive JSON: a pre-rendered head and one format.
            data = b"%s%d\r\n\r\n%s" % (PREFIXES[status], len(payload), payload)
        else:
            media_type = result[2] if len(result) == 3 else JSON_TYPE
            data = render(status, payload, close=not keep_alive, head=head, content_type=media_type)
        self._send(data)
        if not keep_alive:
            self.close()
            raise ParseAbort

"""The frontend's HTTP/1.1 connections: async handlers and streamed responses, served in the
frontend's own event loop by the runtime's HTTP server (``runtime/http_server.py``).

Why our own front (measured in docs/performance.md, "HTTP server choice"): granian handed each
request to our loop over three thread hand-offs (arrival, body, first write: ~0.3-0.5 ms of a
c=1 request). Here a request is parsed in the loop's read callback (httptools), its handler task
is created in the same callback as its headers (the body of a small request arrived with them),
and every byte of the answer goes to the server's native write-behind thread (``_sender.c``):
the socket writes, and on loopback the client's receive path they run, leave the loop's thread
and the GIL. A connection's writes of one loop iteration are handed over together
(``WriteBehind.defer``): one send for a stream's last chunk, its end and ``[DONE]``.

Per connection (contract):

- Requests are parsed as they arrive. One handler task runs at a time; pipelined requests queue
  and are answered in order (reading pauses past :data:`MAX_QUEUED`).
- A handler answers once through :class:`HttpExchange` (``reply`` or ``start_stream``, a
  chunked body ended when the handler returns; one that answers nothing gets a 500).
- Limits (``HttpLimits``): request line + headers over ``max_header_bytes`` (or more than
  :data:`MAX_HEADER_FIELDS` fields) → 431; a head not
  complete within ``header_timeout_s`` → 408; a body not complete within ``body_timeout_s`` of
  the handler asking for it → 408 (the handler's deadline); a body over the handler's limit →
  413, answered at once, the rest of the upload read and dropped for a moment before the
  connection closes (the client reads the answer, not a reset). A connection that sends nothing
  is closed after ``header_timeout_s``, an idle keep-alive one after ``keep_alive_timeout_s``;
  one past ``max_connections`` is answered 503 (OpenAI body, ``Retry-After``) and closed.
- The client closing or half-closing its side is a disconnect: ``disconnected()`` resolves, a
  body read raises :class:`ClientDisconnected`, so do later stream writes; queued requests are
  dropped.
- Back-pressure: a client that does not read keeps its unsent bytes in the write-behind
  thread's backlog, bounded by the server's ``max_backlog_bytes``; past it the thread shuts the
  connection down (a disconnect, as above). Nothing waits on a slow client, and nothing else
  slows down. Without the native thread, writes go through the transport and a stream's
  ``send`` waits while the transport's buffer is over its high-water mark.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, cast
from urllib.parse import unquote

import httptools

from dynamo.frontend.exchange import ClientDisconnected, Exchange
from dynamo.frontend.http_exchange import REFUSAL, HttpExchange, error_response
from dynamo.runtime.http_connection import (
    BUSY,
    CONTINUE,
    HEAD,
    IDLE,
    LINGER_S,
    NEW,
    ParseAbort,
    ServerContext,
    write_behind_fd,
)

log = logging.getLogger(__name__)
_now = time.monotonic

Handler = Callable[[Exchange], Coroutine[Any, Any, None]]
MAX_QUEUED = 8
"""Pipelined requests held per connection before it stops reading."""
MAX_HEADER_FIELDS = 100
"""Header fields a request may have (hyper's default, the reference's): more get 431. Without
it, 30,000 repeats of one short header (within ``max_header_bytes``) cost 0.1 s of the loop."""
FEED_BYTES = 8192
"""A larger read is parsed in slices of this size, the rest held while the queue is full."""
MAX_LINGERING_REFUSALS = 1024
"""Refused connections (past the limit) kept lingering at once; beyond, closed at once."""


class FrontConnection(asyncio.Protocol):
    """One client connection of the frontend (see the module docstring)."""

    __slots__ = (
        "state",
        "since",
        "lost",
        "loop",
        "max_body_bytes",
        "body_timeout_s",
        "write_paused",
        "_ctx",
        "_handler",
        "_transport",
        "_fd",
        "_parser",
        "_url",
        "_headers",
        "_head_bytes",
        "_fields",
        "_parsing",
        "_queue",
        "_running",
        "_task",
        "_closing",
        "_reading_paused",
        "_drain",
        "_lingering",
        "_out",
        "_failure",
        "_held",
    )

    def __init__(
        self,
        ctx: ServerContext,
        handler: Handler,
        max_body_bytes: int,
        lingering: list[int],
    ) -> None:
        self.state = NEW
        self.since = _now()
        self.lost = False
        self.loop = asyncio.get_running_loop()
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = ctx.limits.body_timeout_s
        self.write_paused = False
        self._ctx = ctx
        self._handler = handler
        self._transport: asyncio.Transport | None = None
        self._fd = -1  # the write-behind thread's dup of the socket, while it has one
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._fields = 0
        self._parsing: HttpExchange | None = None  # the request being parsed
        self._queue: deque[HttpExchange] = deque()  # parsed, waiting for the one running
        self._running: HttpExchange | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._lingering = lingering  # shared count of refused connections lingering
        self._out: list[bytes] | None = None  # this iteration's writes, for the write-behind
        self._failure: bytes | None = None  # an error answer waiting for the running handler
        self._held = b""  # input not parsed yet: the queue was full

    # -- asyncio side ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's do not subclass it
        ctx = self._ctx
        if not ctx.accepting():
            self._closing = True
            self._transport.close()
            return
        if len(ctx.connections) >= ctx.limits.max_connections:
            self._refuse()
            return
        self._fd = write_behind_fd(transport, ctx.write_behind)
        ctx.connections.add(self)

    def _refuse(self) -> None:
        """Past the connection limit: the 503 answer, then a close (after a moment)."""
        transport = self._transport
        assert transport is not None
        self._closing = True
        transport.write(REFUSAL)
        if self._lingering[0] >= MAX_LINGERING_REFUSALS or not transport.can_write_eof():
            transport.close()
            return
        self._lingering[0] += 1
        transport.write_eof()

        def close() -> None:
            self._lingering[0] -= 1
            transport.close()

        self.loop.call_later(1.0, close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._ctx.connections.discard(self)
        self._transport = None
        self._closing = True
        self.lost = True
        self.release_fd()
        for ex in (self._running, self._parsing, *self._queue):
            if ex is not None:
                ex.lose()
        self._queue.clear()
        self._parsing = None
        self._wake_writers()

    def eof_received(self) -> bool:
        # A half-close is a disconnect (as HTTP/1.1 clients mean it): the transport closes.
        return False

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # answered and closing (or lingering): input is dropped
        if self._held:  # parsed after what is held, once the queue has room
            self._held += data
            return
        if self.state in (NEW, IDLE):
            self.state = HEAD
            self.since = _now()
        try:
            if len(data) <= FEED_BYTES and len(self._queue) < MAX_QUEUED:
                self._parser.feed_data(data)
            else:  # slice by slice: thousands of tiny pipelined requests in one read must
                # not become thousands of queued exchanges (40x the bytes they came in)
                for at in range(0, len(data), FEED_BYTES):
                    if self._closing:
                        break
                    if len(self._queue) >= MAX_QUEUED:
                        self._held = data[at:]
                        break
                    self._parser.feed_data(data[at : at + FEED_BYTES])
        except ParseAbort:
            pass
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, ParseAbort):
                log.exception("HTTP callback failed")
                self._fail(500, "internal error while reading the request")
        except httptools.HttpParserUpgrade:
            # The request was read whole: it is answered as if it had no Upgrade header (RFC
            # 9110 7.8), but what follows it cannot be parsed: the connection ends after it.
            last = self._queue[-1] if self._queue else self._running
            if last is None:
                self._fail(400, "protocol upgrades are not supported")
            else:
                last.closes = True
                self._closing = True
        except httptools.HttpParserError:
            self._fail(400, "malformed HTTP request")

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writers()

    def _wake_writers(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    async def drained(self) -> None:
        """Wait until the transport's buffer is under its low-water mark (or the client left)."""
        if self._drain is None:
            self._drain = self.loop.create_future()
        await self._drain
        if self.lost:
            raise ClientDisconnected("the client closed the connection")

    def write(self, data: bytes) -> None:
        """Send ``data``: with the write-behind thread, gathered with this iteration's other
        writes (one send for a stream's last chunks, the terminator and ``[DONE]``)."""
        if self._fd >= 0:
            out = self._out
            if out is None:
                self._out = [data]
                write_behind = self._ctx.write_behind
                assert write_behind is not None
                write_behind.defer(self)
            else:
                out.append(data)
        elif self._transport is not None:
            self._transport.write(data)

    def flush_out(self) -> None:
        out = self._out
        self._out = None
        write_behind = self._ctx.write_behind
        if out and self._fd >= 0 and write_behind is not None:
            write_behind.sender_send(self._fd, out[0] if len(out) == 1 else b"".join(out))

    def release_fd(self) -> None:
        """Hand the dup'ed socket to the write-behind thread for closing (after its bytes)."""
        if self._fd >= 0 and self._ctx.write_behind is not None:
            self.flush_out()
            self._ctx.write_behind.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def expire(self) -> None:
        """The sweep: a head not complete in time is a 408; a silent connection just closes."""
        if self.state == HEAD:
            self._fail(408, "the request was not received in time")
        elif self.state != BUSY:
            self.close()
            self.release_fd()

    def _fail(self, status: int, message: str) -> None:
        """Answer an error of the request being read (after what is queued) and end the
        connection, reading and dropping the client's input for a moment first."""
        if self._closing or self._transport is None:
            return
        self._queue.clear()
        parsing, self._parsing = self._parsing, None
        if parsing is not None:
            parsing.lose()  # a handler waiting for its body stops
        answer = error_response(status, message)
        if self._running is not None and self._running is not parsing:
            # an earlier request is being answered: its answer goes first, then this one
            self._closing = True
            self._failure = answer
            return
        self.write(answer)
        self._linger_close()

    def _linger_close(self) -> None:
        transport = self._transport
        self._closing = True
        if transport is None:
            return
        if self._reading_paused:
            transport.resume_reading()
        write_behind = self._ctx.write_behind
        if self._fd >= 0 and write_behind is not None:
            self.flush_out()
            write_behind.shutdown_write(self._fd)
        elif transport.can_write_eof():
            transport.write_eof()
        else:
            transport.close()
            return
        self.loop.call_later(LINGER_S, transport.close)

    # -- httptools callbacks --------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._head_bytes = 0
        self._fields = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._ctx.limits.max_header_bytes:
            self._fail(431, "request headers too large")
            raise ParseAbort

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        self._fields += 1
        if (
            self._head_bytes + len(self._url) > self._ctx.limits.max_header_bytes
            or self._fields > MAX_HEADER_FIELDS
        ):
            self._fail(431, "request headers too large")
            raise ParseAbort
        if self._parsing is not None:  # a chunked body's trailer: not merged (RFC 9110 6.5.1)
            return
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers = self._headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        parser = self._parser
        coding = self._headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            # a coding we would pass on undecoded (gzip, ...): refused, not ignored
            self._fail(501, f"transfer coding {coding!r} is not supported")
            raise ParseAbort
        url = self._url
        if url[:1] != b"/" and url != b"*":  # absolute-form (a proxy's): route by its path
            try:
                url = httptools.parse_url(url).path or b"/"
            except httptools.HttpParserInvalidURLError:
                self._fail(400, "malformed request target")
                raise ParseAbort from None
        path = url.partition(b"?")[0].decode("latin-1")
        if "%" in path:
            path = unquote(path)
        http11 = parser.get_http_version() == "1.1"
        ex = HttpExchange(
            self,
            parser.get_method().decode("latin-1"),
            path,
            self._headers,
            # HTTP/1.0 with a transfer coding: faulty framing, closed after (RFC 9112 6.1)
            parser.should_keep_alive() and (http11 or coding is None),
            http11,
        )
        self._parsing = ex
        if self._running is None:
            self._start(ex)
        else:
            self._queue.append(ex)
            if len(self._queue) >= MAX_QUEUED and self._transport is not None:
                self._reading_paused = True
                self._transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing.feed(body)

    def on_message_complete(self) -> None:
        ex = self._parsing
        self._parsing = None
        if ex is None:
            return
        ex.complete()
        if ex.closes:  # not keep-alive: what follows is not read
            self._closing = True
            raise ParseAbort

    # -- handlers -------------------------------------------------------------------------
    def _start(self, ex: HttpExchange) -> None:
        self._running = ex
        # 100 Continue once the request is the one answered (not inside an earlier answer)
        if (
            not ex._complete
            and (ex.header("expect") or "").lower() == "100-continue"
            and (ex._declared is None or ex._declared <= self.max_body_bytes)
        ):
            self.write(CONTINUE)
        self.state = BUSY
        task = self._task = self.loop.create_task(self._serve(ex))
        task.add_done_callback(self._handled)

    async def _serve(self, ex: HttpExchange) -> None:
        failed = True
        try:
            await self._handler(ex)
            failed = False
        finally:
            # in the handler's last step, so the end leaves with its last writes
            if not self.lost:
                ex.end(failed)

    def _handled(self, task: asyncio.Task[None]) -> None:
        ex = self._running
        self._running = None
        self._task = None
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("HTTP handler failed", exc_info=exc)
        if ex is None or self.lost:
            return
        if self._failure is not None:  # a later request was malformed: its answer, the end
            self.write(self._failure)
            self._failure = None
            self._linger_close()
            return
        if ex.closes:
            if ex.lingers:
                self._linger_close()
            else:
                self.release_fd()
                self.close()
            return
        if self._queue:
            self._start(self._queue.popleft())
        else:
            self.state = HEAD if self._parsing is not None else IDLE
            self.since = _now()
        if self._held:
            held, self._held = self._held, b""
            self.data_received(held)
        # read on once the queue has room and nothing is held (both bounded so)
        if (
            self._reading_paused
            and not self._held
            and len(self._queue) < MAX_QUEUED
            and self._transport is not None
            and not self._closing
        ):
            self._reading_paused = False
            self._transport.resume_reading()

    def cancel(self) -> None:
        """Cancel the running handler (server stop)."""
        if self._task is not None:
            self._task.cancel()


def connection_factory(
    handler: Handler, max_body_bytes: int
) -> Callable[[ServerContext], FrontConnection]:
    """The ``HttpServer(connection=...)`` factory serving ``handler``; bodies are buffered up
    to ``max_body_bytes`` before the handler asks for them with its own limit."""
    lingering = [0]
    return lambda ctx: FrontConnection(ctx, handler, max_body_bytes, lingering)

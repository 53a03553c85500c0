"""One request of the frontend's HTTP connections (``http_front.py``) as the handlers'
:class:`~dynamo.frontend.exchange.Exchange`: the body as it arrives, the answer (whole, or a
chunked stream ended when the handler returns), the client's departure. Response heads and the
connection-level error answers are rendered here too."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from dynamo.frontend.errors import HTTPError, to_http
from dynamo.frontend.exchange import ClientDisconnected, StreamSink
from dynamo.frontend.idle import TaskDeadline
from dynamo.runtime.http_render import reason

if TYPE_CHECKING:
    from dynamo.frontend.http_front import FrontConnection

END = b"0\r\n\r\n"
"""The last chunk of a chunked body."""


def render_head(status: int, headers: list[tuple[str, str]], tail: str) -> bytes:
    """A response head: status line, ``headers``, then ``tail`` (framing, ``connection``)."""
    return (
        b"HTTP/1.1 %s\r\n" % reason(status)
        + "".join([f"{name}: {value}\r\n" for name, value in headers]).encode()
        + (tail.encode())
    )


def error_response(status: int, message: str) -> bytes:
    """A complete ``connection: close`` answer with an OpenAI error body."""
    reply = to_http(HTTPError(status, message))
    head = render_head(
        status,
        [("content-type", "application/json"), *reply.headers],
        f"content-length: {len(reply.body)}\r\nconnection: close\r\n\r\n",
    )
    return head + reply.body


REFUSAL = error_response(503, "too many connections: the server is at its connection limit")
"""The answer to a connection past ``max_connections``."""


class _Sink:
    """A chunked (or, for HTTP/1.0, close-delimited) response body."""

    __slots__ = ("_conn", "_chunked", "_head_only", "ended")

    def __init__(self, conn: FrontConnection, chunked: bool, head_only: bool) -> None:
        self._conn = conn
        self._chunked = chunked
        self._head_only = head_only
        self.ended = False

    async def send(self, data: bytes) -> None:
        conn = self._conn
        if conn.lost:
            raise ClientDisconnected("the client closed the connection")
        if self.ended:
            raise ConnectionError("the response stream has ended")
        if not data or self._head_only:
            return
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        conn.write(data)
        if conn.write_paused:
            await conn.drained()


class HttpExchange:
    """One request of a :class:`FrontConnection`, as the handlers' ``Exchange``."""

    __slots__ = (
        "method",
        "path",
        "_conn",
        "_headers",
        "_declared",
        "_keep_alive",
        "_http11",
        "_parts",
        "_size",
        "_limit",
        "_complete",
        "_discard",
        "_waiter",
        "_gone",
        "_answered",
        "_sink",
        "closes",
        "lingers",
    )

    def __init__(
        self,
        conn: FrontConnection,
        method: str,
        path: str,
        headers: dict[str, str],
        keep_alive: bool,
        http11: bool,
    ) -> None:
        self.method = method
        self.path = path
        self._conn = conn
        self._headers = headers
        declared = headers.get("content-length")
        self._declared = int(declared) if declared is not None and declared.isdigit() else None
        self._keep_alive = keep_alive
        self._http11 = http11
        self._parts: list[bytes] = []
        self._size = 0
        self._limit = conn.max_body_bytes
        self._complete = False
        self._discard = False
        self._waiter: asyncio.Future[None] | None = None
        self._gone: asyncio.Future[None] | None = None
        self._answered = False
        self._sink: _Sink | None = None
        self.closes = not keep_alive
        """The connection ends after this answer (not keep-alive, or request bytes unread)."""
        self.lingers = False
        """... and reads and drops its input for a moment first (an upload left unread)."""

    # -- the handler's side ---------------------------------------------------------------
    def header(self, name: str) -> str | None:
        return self._headers.get(name) or None

    async def body(self, limit: int) -> bytes:
        if (self._declared is not None and self._declared > limit) or self._size > limit:
            self._refuse_body()
            raise HTTPError(413, f"request body exceeds the {limit}-byte limit")
        if not self._complete:
            if self._conn.lost:
                raise ClientDisconnected("the client went away while sending its body")
            self._limit = limit
            waiter = self._waiter = self._conn.loop.create_future()
            try:
                with TaskDeadline(self._conn.body_timeout_s):
                    await waiter
            except TimeoutError:
                self._refuse_body()
                raise HTTPError(408, "the request body was not received in time") from None
            except HTTPError:
                self._refuse_body()
                raise
            finally:
                self._waiter = None
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self._answer()
        tail = f"content-length: {len(body)}\r\n"
        if self.closes:
            tail += "connection: close\r\n"
        elif not self._http11:  # an HTTP/1.0 client keeps the connection only if told so
            tail += "connection: keep-alive\r\n"
        data = render_head(status, headers, tail + "\r\n")
        self._conn.write(data if self.method == "HEAD" else data + body)

    def start_stream(self, status: int, headers: list[tuple[str, str]]) -> StreamSink:
        self._answer()
        if self._http11:
            tail = "transfer-encoding: chunked\r\n"
        else:  # HTTP/1.0 has no chunks: the end of the body is the end of the connection
            self.closes = True
            tail = ""
        if self.closes:
            tail += "connection: close\r\n"
        self._conn.write(render_head(status, headers, tail + "\r\n"))
        self._sink = _Sink(self._conn, self._http11, self.method == "HEAD")
        return self._sink

    def disconnected(self) -> Awaitable[None]:
        if self._gone is None:
            self._gone = self._conn.loop.create_future()
            if self._conn.lost:
                self._gone.set_result(None)
        return self._gone

    def _answer(self) -> None:
        if self._answered:
            raise RuntimeError("the request was already answered")
        self._answered = True
        if not self._complete:  # the rest of the request would be read as the next one
            self.closes = True
            self.lingers = True

    def _refuse_body(self) -> None:
        self._discard = True
        self._parts = []
        self.closes = self.lingers = True

    # -- the connection's side ------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self._discard:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._discard = True
            self._parts = []
            self._wake(HTTPError(413, f"request body exceeds the {self._limit}-byte limit"))
            return
        self._parts.append(data)

    def complete(self) -> None:
        self._complete = True
        self._wake(None)

    def lose(self) -> None:
        """The client went away."""
        if not self._complete:
            self._wake(ClientDisconnected("the client went away while sending its body"))
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)

    def _wake(self, error: BaseException | None) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)

    def end(self, failed: bool = False) -> None:
        """The handler returned (or ``failed``: raised, was cancelled): end a stream, or answer
        500 if it answered nothing. A failed stream gets no last chunk: the connection closes
        with the body unterminated, so the client sees it cut short, not complete."""
        if self._sink is not None:
            self._sink.ended = True
            if failed:
                self.closes = True
            elif self._http11 and self.method != "HEAD":
                self._conn.write(END)
        elif not self._answered:
            self._answered = True
            self.closes = True
            self._conn.write(error_response(500, "the request was not answered"))

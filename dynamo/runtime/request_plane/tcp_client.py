"""The TCP request-plane client: a small pool of connections per address, each multiplexing
many streams by stream id; cancel and credit frames flow back to the server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from dynamo.runtime import codec
from dynamo.runtime.codec import FrameError
from dynamo.runtime.context import Context
from dynamo.runtime.errors import (
    CannotConnect,
    ConnectionTimeout,
    Disconnected,
    DynamoError,
    InvalidArgument,
    StreamIncomplete,
)
from dynamo.runtime.request_plane.streams import (
    DEFAULT_WINDOW,
    Inbox,
    iterate,
    iterate_batches,
)
from dynamo.runtime.request_plane.tcp_connection import FrameWriter

log = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` (or ``host:port``; IPv6 hosts in brackets) -> (host, port)."""
    rest = address.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgument(f"not a tcp request-plane address: {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


class _ClientConnection(FrameWriter):
    """One pooled connection; routes RESPONSE frames to their stream's inbox."""

    def __init__(self, client: TCPRequestPlaneClient, address: str) -> None:
        super().__init__(asyncio.get_running_loop(), client.max_frame_size)
        self.client = client
        self.address = address
        self.streams: dict[int, _TCPInbox] = {}
        self._next_sid = 0
        self._close_reason: DynamoError | None = None

    def open_stream(self, inbox: _TCPInbox, path: str, body: bytes, ctx: Context) -> int:
        sid = self._next_sid + 1
        if sid > codec.MAX_STREAM_ID or sid in self.streams:  # after 2**32 streams: find a gap
            sid = 1
            while sid in self.streams:
                sid += 1
        self._next_sid = sid
        header = codec.RequestHeader(path, ctx.id, inbox.window)
        head, size = codec.request_frame(sid, header, body)
        if size > self.max_frame_size:
            raise InvalidArgument(
                f"request of {size} bytes exceeds the maximum frame size {self.max_frame_size}"
            )
        self.streams[sid] = inbox
        if self.client.batching:  # retries after a lost connection: they leave together
            self.write(head)
            if body:
                self.write(body)
        else:  # at once, when it is the first frame of this loop iteration
            self.write_leading(head, body)
        return sid

    def send_control(self, kind: int, sid: int, arg: int) -> None:
        if self.transport is not None:
            self.write(codec.control_frame(kind, sid, arg))

    def abandon(self, sid: int) -> None:
        if self.streams.pop(sid, None) is not None:
            self.send_control(codec.CANCEL, sid, codec.CANCEL_RESET)

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            frames = self.decoder.feed(data)
            streams = self.streams
            decode = codec.decode_response
            for kind, sid, _arg, _header, body in frames:
                if kind != codec.RESPONSE:
                    raise FrameError(f"unexpected frame kind {kind} from a server")
                inbox = streams.get(sid)
                if inbox is None:
                    if sid == 0:
                        self._on_connection_error(body)
                    continue  # a stream this client abandoned
                what, value = decode(body)
                if what == codec.RESP_DATA:
                    inbox.push(value)  # type: ignore[arg-type]
                elif what == codec.RESP_FINAL:
                    del streams[sid]
                    inbox.finish()
                elif what == codec.RESP_ERROR:
                    del streams[sid]
                    inbox.fail(value)  # type: ignore[arg-type]
        except FrameError as exc:
            log.error("request plane: bad frame from %s: %s", self.address, exc)
            self.broken = True
            self.shut(StreamIncomplete(f"bad frame from {self.address}: {exc}"))

    def _on_connection_error(self, body: bytes) -> None:
        _, value = codec.decode_response(body)
        if isinstance(value, DynamoError):
            log.error("request plane: %s closes the connection: %s", self.address, value)
            self._close_reason = StreamIncomplete(
                f"stream ended before complete_final: {self.address} closed the connection"
                f" ({value.kind}: {value.message})"
            )

    def shut(self, reason: DynamoError) -> None:
        """Close the connection; its open streams fail with ``reason``."""
        if self._close_reason is None:
            self._close_reason = reason
        self.client._forget(self)
        self.close()

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.client._forget(self)
        reason = self._close_reason
        if reason is None:
            cause = f": {exc}" if exc is not None else ""
            reason = StreamIncomplete(
                f"stream ended before complete_final: connection to {self.address} lost{cause}"
            )
        streams, self.streams = self.streams, {}
        for inbox in streams.values():
            inbox.fail(type(reason)(reason.message))
        if streams:
            # Their consumers run next turn, in this order; those that retry elsewhere (request
            # migration) queue their requests on other connections as they go. Those requests
            # leave right after the last of them, together (a new instance batches what arrives
            # together), instead of at the end of that turn, behind everything else it runs.
            self.client.batching = True
            self.loop.call_soon(self.client.flush_all)


class _CancelForwarder(Context):
    """A child of the caller's context that turns stop/kill into CANCEL frames.

    ``Context`` calls ``stop_generating()`` / ``kill()`` on its children, so overriding them here
    forwards both signals (a kill after a stop included) without a callback or task per stream.
    """

    __slots__ = ("_inbox",)

    def __init__(self, inbox: _TCPInbox, parent: Context) -> None:
        self._inbox = inbox  # before Context.__init__, which may stop us at once
        super().__init__(parent.id, parent=parent)

    def stop_generating(self) -> None:
        if not self.is_stopped() and not self.is_killed():
            self._inbox.cancel(codec.CANCEL_STOP)
        super().stop_generating()

    def kill(self) -> None:
        if not self.is_killed():
            self._inbox.cancel(codec.CANCEL_KILL)
        super().kill()


class _TCPInbox(Inbox):
    __slots__ = ("window", "_client", "_address", "_path", "_body", "_ctx", "_conn", "_sid", "_fwd")

    def __init__(
        self,
        client: TCPRequestPlaneClient,
        address: str,
        path: str,
        body: bytes,
        ctx: Context,
        window: int,
    ) -> None:
        super().__init__(window)
        self.window = window
        self._client = client
        self._address = address
        self._path = path
        self._body = body
        self._ctx = ctx
        self._conn: _ClientConnection | None = None
        self._sid = 0
        self._fwd: _CancelForwarder | None = None

    async def open(self) -> None:
        conn = await self._client._acquire(self._address)
        body, self._body = self._body, b""
        self._sid = conn.open_stream(self, self._path, body, self._ctx)
        self._conn = conn
        self.loop = conn.loop
        self._fwd = _CancelForwarder(self, self._ctx)

    def cancel(self, mode: int) -> None:
        if not self.ended and self._conn is not None:
            self._conn.send_control(codec.CANCEL, self._sid, mode)

    def grant(self, n: int) -> None:
        if self._conn is not None:
            self._conn.send_control(codec.CREDIT, self._sid, n)

    def abandon(self) -> None:
        if self._conn is not None:
            self._conn.abandon(self._sid)

    def release(self) -> None:
        if self._fwd is not None:
            self._fwd.detach()
            self._fwd = None


class TCPRequestPlaneClient:
    """Streams requests to TCP request-plane servers (see ``base.RequestPlaneClient``).

    Per address it keeps up to ``max_connections`` connections and opens another only when every
    one carries ``streams_per_connection`` streams, so low concurrency shares one connection (and
    its coalesced writes). ``window`` is each stream's flow-control window in frames.
    """

    def __init__(
        self,
        *,
        max_connections: int = 4,
        streams_per_connection: int = 256,
        window: int = DEFAULT_WINDOW,
        connect_timeout: float = 5.0,
        max_frame_size: int | None = None,
    ) -> None:
        if max_connections < 1 or streams_per_connection < 1:
            raise ValueError("max_connections and streams_per_connection must be at least 1")
        if not 1 <= window <= codec.MAX_ARG:
            raise ValueError(f"window must be in [1, {codec.MAX_ARG}]")
        self.max_frame_size = max_frame_size or codec.DEFAULT_MAX_FRAME_SIZE
        self._max_connections = max_connections
        self._streams_per_connection = streams_per_connection
        self._window = window
        self._connect_timeout = connect_timeout
        self._pools: dict[str, list[_ClientConnection]] = {}
        self._connecting: dict[str, asyncio.Future[None]] = {}
        self._all: set[_ClientConnection] = set()
        self._closed = False
        # Set while the streams of a lost connection fail, until ``flush_all``: their retries
        # are queued, not sent one by one (a new instance batches what arrives together).
        self.batching = False

    def stream(
        self, address: str, endpoint_path: str, body: bytes, ctx: Context
    ) -> AsyncGenerator[bytes, None]:
        return iterate(_TCPInbox(self, address, endpoint_path, body, ctx, self._window))

    def stream_batches(
        self, address: str, endpoint_path: str, body: bytes, ctx: Context
    ) -> AsyncGenerator[list[bytes], None]:
        return iterate_batches(_TCPInbox(self, address, endpoint_path, body, ctx, self._window))

    def num_connections(self, address: str | None = None) -> int:
        if address is None:
            return len(self._all)
        return len(self._pools.get(address, ()))

    def _pick(self, address: str) -> _ClientConnection | None:
        """The least-loaded connection, or None when another one should be opened."""
        pool = self._pools.get(address)
        if not pool:
            return None
        best = pool[0] if len(pool) == 1 else min(pool, key=lambda c: len(c.streams))
        if len(best.streams) >= self._streams_per_connection and len(pool) < self._max_connections:
            return None
        return best

    async def _acquire(self, address: str) -> _ClientConnection:
        while True:
            if self._closed:
                raise CannotConnect("the request-plane client is closed")
            conn = self._pick(address)
            if conn is not None:
                return conn
            pending = self._connecting.get(address)
            if pending is not None:
                # Someone is connecting and there is nothing to use yet: wait for them (without
                # cancelling their future if we are cancelled), then pick again.
                await asyncio.wait((pending,))
                continue
            done = self._connecting[address] = asyncio.get_running_loop().create_future()
            try:
                conn = await self._connect(address)
                self._pools.setdefault(address, []).append(conn)
                return conn
            finally:
                del self._connecting[address]
                done.set_result(None)

    async def _connect(self, address: str) -> _ClientConnection:
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(self, address), host, port
                )
        except TimeoutError as exc:
            raise ConnectionTimeout(f"connecting to {address} timed out") from exc
        except OSError as exc:
            raise CannotConnect(f"cannot connect to {address}: {exc}") from exc
        self._all.add(conn)
        if self._closed:  # close() ran while connecting
            conn.shut(Disconnected("the request-plane client is closed"))
            await conn.closed
            raise CannotConnect("the request-plane client is closed")
        return conn

    def flush_all(self) -> None:
        """Send what every connection has queued, now rather than at its own flush (and end
        the batch of retries that ``batching`` holds back)."""
        self.batching = False
        for conn in self._all:
            conn.flush()

    def _forget(self, conn: _ClientConnection) -> None:
        pool = self._pools.get(conn.address)
        if pool is not None and conn in pool:
            pool.remove(conn)
            if not pool:
                del self._pools[conn.address]
        self._all.discard(conn)

    async def close(self) -> None:
        """Close every connection; streams still open fail with ``Disconnected``."""
        self._closed = True
        conns = list(self._all)
        for conn in conns:
            conn.shut(Disconnected("the request-plane client was closed"))
        await asyncio.gather(*(conn.closed for conn in conns))

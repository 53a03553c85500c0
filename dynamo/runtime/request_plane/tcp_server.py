"""The TCP request-plane server: one listener per process for all endpoints, many streams per
connection, frames from :mod:`dynamo.runtime.codec`.

Writes are coalesced: frames produced during one event-loop iteration go out in one
``transport.write``. Backpressure is the per-stream credit window (``streams.py``) plus the
transport's write-buffer limits: while the socket is saturated every producer of that connection
waits.
"""

from __future__ import annotations

import asyncio
import logging
import time

from dynamo.runtime import codec
from dynamo.runtime.codec import FrameError
from dynamo.runtime.context import Context
from dynamo.runtime.request_plane.base import Handler
from dynamo.runtime.request_plane.streams import Outbox, run_handler
from dynamo.runtime.request_plane.tcp_connection import FrameWriter

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT = 16_384
DEFAULT_MAX_CONNECTIONS = 4_096
DEFAULT_FRAME_TIMEOUT_S = 30.0


def _kill(ctx: Context) -> None:
    try:
        ctx.kill()
    except Exception:  # a handler's on_stop callback must not break the server
        log.exception("context callback failed (request %s)", ctx.id)


class _ServerStream(Outbox):
    __slots__ = ("conn", "sid", "ctx")

    def __init__(self, conn: _ServerConnection, sid: int, ctx: Context, window: int) -> None:
        super().__init__(window, conn.loop)
        self.conn = conn
        self.sid = sid
        self.ctx = ctx

    def send(self, body: bytes) -> None:
        self.conn.write_data(self.sid, body)

    def send_final(self) -> None:
        self.conn.write(codec.final_frame(self.sid))

    def send_error(self, kind: str, message: str) -> None:
        self.conn.write(codec.error_frame(self.sid, kind, message))

    def blocked(self) -> bool:
        return self.conn.paused

    async def wait_ready(self) -> None:
        while not self.reset:
            if self.credit <= 0:
                await super().wait_ready()
            elif self.conn.paused:
                await self.conn.drained()
            else:
                return


class _ServerConnection(FrameWriter):
    """One accepted connection: a stream (and a task) per REQUEST frame."""

    def __init__(self, server: TCPRequestPlaneServer, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop, server.max_frame_size)
        self.server = server
        self.streams: dict[int, _ServerStream] = {}
        # For the stall sweep: when the connection started waiting for a frame to complete
        # (connected, or a frame began and has not ended); None while it has no frame pending.
        self.waiting_since: float | None = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        server = self.server
        if len(server._connections) >= server.max_connections:
            # a clear refusal past the connection limit, not a hang
            log.warning("request plane: refusing a connection from %s: at the limit", self.peer)
            self.broken = True
            message = f"the request plane is at its limit of {server.max_connections} connections"
            self.write(codec.error_frame(0, "Overloaded", message))
            self.close()
            return
        server._connections.add(self)
        if server._stopping:
            self.close()

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            frames = self.decoder.feed(data)
            if self.decoder.pending():
                if self.waiting_since is None:
                    self.waiting_since = time.monotonic()
            else:
                self.waiting_since = None
            streams = self.streams
            for kind, sid, arg, header, body in frames:
                if kind == codec.CREDIT:
                    stream = streams.get(sid)
                    if stream is not None:
                        stream.add_credit(arg)
                elif kind == codec.REQUEST:
                    self._on_request(sid, header, body)
                elif kind == codec.CANCEL:
                    self._on_cancel(sid, arg)
                else:
                    raise FrameError(f"unexpected frame kind {kind} from a client")
        except FrameError as exc:
            self._protocol_error(str(exc))

    def _on_request(self, sid: int, raw_header: bytes, body: bytes) -> None:
        header = codec.decode_request_header(raw_header)
        if sid in self.streams or sid == 0:
            raise FrameError(f"stream id {sid} reused or invalid")
        server = self.server
        handler = server._handlers.get(header.endpoint)
        if server._stopping:  # the worker is leaving: the caller may retry elsewhere
            message = f"the worker at {server.address} is shutting down"
            self.write(codec.error_frame(sid, "WorkerShutdown", message))
            return
        if handler is None:
            message = f"endpoint {header.endpoint!r} is not served at {server.address}"
            self.write(codec.error_frame(sid, "NoInstances", message))
            return
        if server._inflight >= server.max_inflight:
            message = f"{server._inflight} requests in flight at {server.address}; retry later"
            self.write(codec.error_frame(sid, "Overloaded", message))
            return
        window = min(max(header.window, 1), codec.MAX_ARG)
        stream = _ServerStream(self, sid, Context(header.request_id or None), window)
        self.streams[sid] = stream
        server._spawn(stream, handler, body)

    def _on_cancel(self, sid: int, mode: int) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return  # already finished
        if mode == codec.CANCEL_STOP:
            try:
                stream.ctx.stop_generating()
            except Exception:
                log.exception("context callback failed (request %s)", stream.ctx.id)
            return
        if mode != codec.CANCEL_KILL:  # CANCEL_RESET: the client stopped reading
            stream.reset_stream()
        _kill(stream.ctx)

    def _protocol_error(self, message: str) -> None:
        log.error("request plane: closing connection from %s: %s", self.peer, message)
        self.broken = True
        self.write(codec.error_frame(0, "InvalidArgument", message))
        self.close()

    def eof_received(self) -> bool | None:
        return None  # clients never half-close: EOF means gone

    def connection_lost(self, exc: Exception | None) -> None:
        if self.decoder.pending() and not self.broken:
            log.error(
                "request plane: connection from %s closed inside a frame (truncated, %d bytes)",
                self.peer,
                self.decoder.pending(),
            )
        super().connection_lost(exc)
        self.server._connections.discard(self)
        for stream in list(self.streams.values()):
            stream.reset_stream()
            _kill(stream.ctx)


class TCPRequestPlaneServer:
    """Serves all endpoints of this process on one TCP listener (see ``base.RequestPlaneServer``).

    ``max_frame_size`` bounds a frame's header + body (default
    32 MiB); a peer that sends garbage, a truncated or an oversized frame has its connection
    closed (logged), the server and its other connections carry on.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_frame_size: int | None = None,
        max_inflight: int | None = None,
        max_connections: int | None = None,
        frame_timeout_s: float | None = None,
        advertise_host: str = "",
    ) -> None:
        """``max_inflight`` (default 16,384) bounds the handlers
        running at once: a flood of requests gets ``Overloaded`` instead of unbounded tasks.
        ``max_connections`` (4,096): one more connection gets an
        ``Overloaded`` error frame and is closed. ``frame_timeout_s``
        (30 s): a connection that sends no first frame, or stops
        in the middle of one, for that long is closed (idle pooled connections between frames
        are left alone). ``advertise_host`` (default: ``host``) is the host in :attr:`address`,
        what peers dial: set it when binding a wildcard or an address others reach through
        NAT. The process's values come from :class:`~dynamo.runtime.config.RuntimeConfig`
        (``--tcp-*`` flags, ``DYN_TCP_*`` twins); None here means the default."""
        self.host = host
        self.advertise_host = advertise_host or host
        self.port = port
        self.max_frame_size = max_frame_size or codec.DEFAULT_MAX_FRAME_SIZE
        self.max_inflight = max_inflight or DEFAULT_MAX_INFLIGHT
        self.max_connections = max_connections or DEFAULT_MAX_CONNECTIONS
        self.frame_timeout_s = frame_timeout_s or DEFAULT_FRAME_TIMEOUT_S
        self._sweeper: asyncio.TimerHandle | None = None
        self._handlers: dict[str, Handler] = {}
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight = 0  # streams whose handler has not finished (exact, unlike len(_tasks))
        self._stopping = False

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("the request-plane server is not started")
        advertised = self.advertise_host
        host = f"[{advertised}]" if ":" in advertised else advertised
        return f"tcp://{host}:{self.port}"

    async def start(self) -> None:
        if self._stopping:
            raise RuntimeError("a stopped request-plane server cannot be restarted")
        if self._server is not None:
            return
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self, loop), self.host, self.port, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = loop.call_later(self._sweep_period(), self._sweep)

    def _sweep_period(self) -> float:
        return min(1.0, max(0.01, self.frame_timeout_s / 4))

    def _sweep(self) -> None:
        """Close the connections stuck before or inside a frame for ``frame_timeout_s``."""
        now = time.monotonic()
        limit = self.frame_timeout_s
        for conn in list(self._connections):
            since = conn.waiting_since
            if since is not None and now - since > limit and not conn.broken:
                conn._protocol_error(f"no complete frame within {limit:g} s")
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_period(), self._sweep)

    def register(self, endpoint_path: str, handler: Handler) -> None:
        self._handlers[endpoint_path] = handler

    def unregister(self, endpoint_path: str) -> None:
        self._handlers.pop(endpoint_path, None)

    def num_inflight(self) -> int:
        return self._inflight

    def _spawn(self, stream: _ServerStream, handler: Handler, body: bytes) -> None:
        task = stream.conn.loop.create_task(
            self._serve(stream, handler, body), name=f"tcp-rp:{stream.ctx.id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._inflight += 1

    async def _serve(self, stream: _ServerStream, handler: Handler, body: bytes) -> None:
        try:
            await run_handler(handler, body, stream.ctx, stream)
        finally:
            self._inflight -= 1
            stream.conn.streams.pop(stream.sid, None)

    async def stop(self) -> None:
        """Stop listening, kill and cancel in-flight handlers, close connections (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            for stream in list(conn.streams.values()):
                _kill(stream.ctx)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._inflight = 0  # tasks cancelled before their first step never ran _serve's cleanup
        connections = list(self._connections)
        for conn in connections:
            conn.close()
        await asyncio.gather(*(conn.closed for conn in connections))
        if self._server is not None:
            await self._server.wait_closed()

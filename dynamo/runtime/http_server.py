"""A small HTTP/1.1 server: asyncio protocols + llhttp (httptools), keep-alive.

Used by the slot tracker and the workers' status servers (``http_json.HttpProtocol``:
synchronous JSON handlers) and by the OpenAI frontend, whose connections
(``frontend/http_front.py``: async handlers, streamed responses) plug in through
``HttpServer(connection=...)`` (the contract: ``http_connection.py``) and share the listener,
the connection limit, the timeout sweep and the write-behind thread.

``write_behind=True`` hands every response to a native write-behind thread
(``dynamo.runtime.sender``, imported only then): each connection's socket is dup'ed and
written there without the GIL, so the kernel's send path (on loopback it also runs the
receiver's input path) overlaps with parsing and answering the next requests. Responses of one
event loop iteration are handed over together: the thread is woken at most once per iteration.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from dynamo.runtime.http_connection import Connection, ConnectionFactory, ServerContext
from dynamo.runtime.http_json import DEFAULT_MAX_BODY_BYTES, App, HttpProtocol, native_path
from dynamo.runtime.http_limits import HttpLimits
from dynamo.runtime.write_behind import WriteBehind

_now = time.monotonic
DEFAULT_MAX_BACKLOG_BYTES = 16 * 1024 * 1024
"""Unread response bytes a write-behind connection may hold before it is shut down."""


class HttpServer:
    """Listens on (host, port) and serves ``app``; ``port=0`` picks a free port (see ``port``).

    ``write_behind``: write responses from a native thread (see the module docstring); a
    client that leaves more than ``max_backlog_bytes`` of responses unread is disconnected.
    ``busy_poll_s``: under load, keep the loop polling this long after answering (see
    ``WriteBehind``); 0 disables it. ``limits``: connection limit, timeouts, header size
    (``http_limits.py``); the timeouts are enforced by one sweep per server (a timer every
    ``_sweep_period``), so a request costs no timer of its own. ``connection``: instead of
    ``app`` (give None), each accepted connection's protocol (see ``ConnectionFactory``).
    """

    def __init__(
        self,
        app: App | None,
        host: str,
        port: int,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        write_behind: bool = False,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
        busy_poll_s: float = 0.0,
        limits: HttpLimits | None = None,
        connection: ConnectionFactory | None = None,
    ) -> None:
        self.limits = limits or HttpLimits()
        self._make_connection = connection
        self._sweeper: asyncio.TimerHandle | None = None
        if (app is None) == (connection is None):
            raise ValueError("give exactly one of app and connection")
        self._native_path = None if app is None else native_path(app, self.limits, max_body_bytes)
        if busy_poll_s < 0 or (busy_poll_s and not write_behind):
            raise ValueError("busy_poll_s must be >= 0 and needs write_behind")
        self._busy_poll_s = busy_poll_s
        self._app = app
        self._host = host
        self._port = port
        self._limit = max_body_bytes
        self._use_write_behind = write_behind
        self._max_backlog = max_backlog_bytes
        self._write_behind: WriteBehind | None = None
        self._serving = False  # False: connections the loop still accepts are closed at once
        self._server: asyncio.Server | None = None
        self._connections: set[Connection] = set()

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("server not started")
        return int(self._server.sockets[0].getsockname()[1])

    def _is_serving(self) -> bool:
        return self._serving

    @property
    def dropped_connections(self) -> int:
        """Write-behind connections shut down because their client stopped reading."""
        return 0 if self._write_behind is None else self._write_behind.dropped_connections

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._use_write_behind:
            self._write_behind = WriteBehind(loop, self._max_backlog, self._busy_poll_s)
        write_behind = self._write_behind
        self._serving = True
        factory: Callable[[], asyncio.Protocol]
        if self._make_connection is not None:
            context = ServerContext(self._connections, write_behind, self._is_serving, self.limits)
            make = self._make_connection
            factory = lambda: make(context)  # noqa: E731
        else:
            app = self._app
            assert app is not None
            factory = lambda: HttpProtocol(  # noqa: E731
                app,
                self._limit,
                self._connections,  # type: ignore[arg-type]
                write_behind,
                self._is_serving,
                self.limits,
                self._native_path,
            )
        try:
            self._server = await loop.create_server(
                factory,
                self._host,
                self._port,
                backlog=1024,
                reuse_address=True,
            )
        except BaseException:
            self._serving = False
            if write_behind is not None:
                write_behind.stop(0.0)
            self._write_behind = None
            raise
        self._sweeper = loop.call_later(self._sweep_period(), self._sweep)

    def _sweep_period(self) -> float:
        lim = self.limits
        shortest = min(lim.header_timeout_s, lim.body_timeout_s, lim.keep_alive_timeout_s)
        return min(1.0, max(0.01, shortest / 4))

    def _sweep(self) -> None:
        """Close the connections whose current state (idle, headers, body) outlived its limit."""
        lim = self.limits
        timeouts = (
            lim.keep_alive_timeout_s,
            lim.header_timeout_s,
            lim.body_timeout_s,
            lim.header_timeout_s,
            float("inf"),
        )
        now = _now()
        for conn in [c for c in self._connections if now - c.since > timeouts[c.state]]:
            conn.expire()
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_period(), self._sweep)

    async def stop(self, drain_timeout_s: float = 1.0) -> None:
        """Stop listening and close every open connection (queued responses are still sent)."""
        if self._server is None:
            return
        self._serving = False
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._server.close()
        for conn in list(self._connections):
            conn.close()
            conn.release_fd()
        await self._server.wait_closed()
        self._server = None
        # Connections accepted while the listener closed were made during the wait: end them too.
        for conn in list(self._connections):
            conn.close()
            conn.release_fd()
        if self._write_behind is not None:
            # Joins the thread: waits only for clients too slow to take their last responses.
            self._write_behind.stop(drain_timeout_s)
            self._write_behind = None

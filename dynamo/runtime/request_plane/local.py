"""The in-process request plane: servers registered in a :class:`LocalHub`, bodies passed as-is.

Same semantics as the TCP plane (``complete_final``, typed errors, stop/kill, abandon on early
exit, credit-window backpressure), without sockets. The handler's context is a child of the
caller's, so stop and kill reach it directly.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator

from dynamo.runtime.context import Context
from dynamo.runtime.errors import (
    CannotConnect,
    NoInstances,
    StreamIncomplete,
    WorkerShutdown,
    from_kind,
)
from dynamo.runtime.request_plane.base import Handler
from dynamo.runtime.request_plane.streams import (
    DEFAULT_WINDOW,
    Inbox,
    Outbox,
    iterate,
    iterate_batches,
    run_handler,
)

ADDRESS_SCHEME = "local://"


class LocalHub:
    """The registry of in-process servers by address; share one per process (or per test)."""

    __slots__ = ("_servers",)

    def __init__(self) -> None:
        self._servers: dict[str, LocalRequestPlaneServer] = {}

    def attach(self, server: LocalRequestPlaneServer) -> None:
        if server.address in self._servers:
            raise ValueError(f"a local request-plane server already serves {server.address}")
        self._servers[server.address] = server

    def detach(self, server: LocalRequestPlaneServer) -> None:
        if self._servers.get(server.address) is server:
            del self._servers[server.address]

    def lookup(self, address: str) -> LocalRequestPlaneServer | None:
        return self._servers.get(address)


class _LocalOutbox(Outbox):
    __slots__ = ("_inbox",)

    def __init__(self, inbox: _LocalInbox, window: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(window, loop)
        self._inbox = inbox

    def send(self, body: bytes) -> None:
        self._inbox.push(body)

    def send_final(self) -> None:
        self._inbox.finish()

    def send_error(self, kind: str, message: str) -> None:
        # Rebuilt from the kind, as the TCP plane does, so callers never share the handler's object.
        self._inbox.fail(from_kind(kind, message))


class LocalRequestPlaneServer:
    """Serves this process's endpoints to :class:`LocalRequestPlaneClient` s of the same hub."""

    def __init__(self, hub: LocalHub, name: str | None = None) -> None:
        self._hub = hub
        self._address = ADDRESS_SCHEME + (name or uuid.uuid4().hex[:12])
        self._handlers: dict[str, Handler] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._streams: dict[Context, _LocalInbox] = {}  # in flight, by the handler's context
        self._started = False
        self._stopped = False

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> None:
        if self._stopped:
            raise RuntimeError("a stopped request-plane server cannot be restarted")
        if not self._started:
            self._hub.attach(self)
            self._started = True

    def register(self, endpoint_path: str, handler: Handler) -> None:
        self._handlers[endpoint_path] = handler

    def unregister(self, endpoint_path: str) -> None:
        self._handlers.pop(endpoint_path, None)

    def num_inflight(self) -> int:
        return len(self._streams)

    def open(self, endpoint_path: str, body: bytes, ctx: Context, inbox: _LocalInbox) -> None:
        """Start serving one stream into ``inbox`` (called by the client, on the loop's thread)."""
        handler = self._handlers.get(endpoint_path)
        if self._stopped:  # the worker is leaving: the caller may retry elsewhere
            inbox.fail(WorkerShutdown(f"the worker at {self._address} is shutting down"))
            return
        if handler is None:
            inbox.fail(NoInstances(f"endpoint {endpoint_path!r} is not served at {self._address}"))
            return
        loop = inbox.loop or asyncio.get_running_loop()
        out = _LocalOutbox(inbox, inbox.window, loop)
        inbox.outbox = out
        self._streams[ctx] = inbox
        task = loop.create_task(
            self._serve(handler, body, ctx, out, inbox), name=f"local-rp:{ctx.id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(
        self, handler: Handler, body: bytes, ctx: Context, out: _LocalOutbox, inbox: _LocalInbox
    ) -> None:
        try:
            await run_handler(handler, body, ctx, out)
        finally:
            self._streams.pop(ctx, None)
            if not inbox.ended:  # cancelled mid-stream (server stopped)
                inbox.fail(self._incomplete())

    async def stop(self) -> None:
        """Detach from the hub, kill and cancel in-flight handlers and wait for them."""
        if self._stopped:
            return
        self._stopped = True
        self._hub.detach(self)
        for ctx in list(self._streams):
            ctx.kill()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Tasks cancelled before their first step never ran _serve's cleanup.
        for inbox in self._streams.values():
            inbox.fail(self._incomplete())
        self._streams.clear()

    def _incomplete(self) -> StreamIncomplete:
        return StreamIncomplete(f"stream ended before complete_final ({self._address})")


class _LocalInbox(Inbox):
    __slots__ = ("window", "outbox", "_hub", "_address", "_path", "_body", "_ctx", "_child")

    def __init__(
        self, hub: LocalHub, address: str, path: str, body: bytes, ctx: Context, window: int
    ) -> None:
        super().__init__(window)
        self.window = window
        self.outbox: _LocalOutbox | None = None
        self._hub = hub
        self._address = address
        self._path = path
        self._body = body
        self._ctx = ctx
        self._child: Context | None = None

    async def open(self) -> None:
        server = self._hub.lookup(self._address)
        if server is None:
            raise CannotConnect(f"no local request-plane server at {self._address}")
        self.loop = asyncio.get_running_loop()
        self._child = self._ctx.child()
        body, self._body = self._body, b""
        server.open(self._path, body, self._child, self)

    def grant(self, n: int) -> None:
        if self.outbox is not None:
            self.outbox.add_credit(n)

    def abandon(self) -> None:
        if self._child is not None:
            self._child.kill()
        if self.outbox is not None:
            self.outbox.reset_stream()

    def release(self) -> None:
        if self._child is not None:
            self._child.detach()


class LocalRequestPlaneClient:
    """Opens streams to :class:`LocalRequestPlaneServer` s of ``hub``."""

    def __init__(self, hub: LocalHub, *, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self._hub = hub
        self._window = window

    def stream(
        self, address: str, endpoint_path: str, body: bytes, ctx: Context
    ) -> AsyncGenerator[bytes, None]:
        return iterate(_LocalInbox(self._hub, address, endpoint_path, body, ctx, self._window))

    def stream_batches(
        self, address: str, endpoint_path: str, body: bytes, ctx: Context
    ) -> AsyncGenerator[list[bytes], None]:
        inbox = _LocalInbox(self._hub, address, endpoint_path, body, ctx, self._window)
        return iterate_batches(inbox)

    async def close(self) -> None:
        """Nothing to release: streams belong to their servers."""

"""Request cancellation: a ``Context`` per request, with parent/child propagation.

``stop_generating()`` asks the producer to finish gracefully (it should emit a ``cancelled``
terminal); ``kill()`` asks it to stop at once. Killing implies stopping. Stopping a parent stops
its children. All methods must be called from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable


class Context:
    __slots__ = ("_id", "_parent", "_children", "_stopped", "_killed", "_callbacks")

    def __init__(self, request_id: str | None = None, parent: Context | None = None) -> None:
        self._id = request_id or uuid.uuid4().hex
        self._parent = parent
        self._children: list[Context] = []
        self._stopped: asyncio.Event | None = None
        self._killed: asyncio.Event | None = None
        self._callbacks: list[Callable[[Context], None]] = []
        # Events are created lazily: most requests are never awaited on, and creating an Event
        # per request is measurable on the hot path.
        if parent is not None:
            parent._children.append(self)
            if parent.is_killed():
                self.kill()
            elif parent.is_stopped():
                self.stop_generating()

    # -- identity -------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self._id

    @property
    def parent(self) -> Context | None:
        return self._parent

    def child(self, request_id: str | None = None) -> Context:
        """A new context that is stopped/killed whenever this one is."""
        return Context(request_id or self._id, parent=self)

    # -- signalling ------------------------------------------------------------------------
    def stop_generating(self) -> None:
        if self._stopped is None:
            self._stopped = asyncio.Event()
        if self._stopped.is_set():
            return
        self._stopped.set()
        for cb in list(self._callbacks):
            cb(self)
        for child in self._children:
            child.stop_generating()

    def kill(self) -> None:
        if self._killed is None:
            self._killed = asyncio.Event()
        if self._killed.is_set():
            return
        self._killed.set()
        self.stop_generating()
        for child in self._children:
            child.kill()

    def is_stopped(self) -> bool:
        return self._stopped is not None and self._stopped.is_set()

    def is_killed(self) -> bool:
        return self._killed is not None and self._killed.is_set()

    async def stopped(self) -> None:
        """Wait until the context is stopped (or killed)."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
        await self._stopped.wait()

    async def killed(self) -> None:
        if self._killed is None:
            self._killed = asyncio.Event()
        await self._killed.wait()

    def on_stop(self, callback: Callable[[Context], None]) -> Callable[[], None]:
        """Call ``callback(ctx)`` when the context stops (at once if it already has).

        Returns a function that removes the callback. Callbacks run synchronously inside
        ``stop_generating()`` and must not raise.
        """
        if self.is_stopped():
            callback(self)
            return lambda: None
        self._callbacks.append(callback)

        def remove() -> None:
            try:
                self._callbacks.remove(callback)
            except ValueError:
                pass

        return remove

    def detach(self) -> None:
        """Remove this context from its parent (call when the request ends, to free memory)."""
        if self._parent is not None:
            try:
                self._parent._children.remove(self)
            except ValueError:
                pass

    def __repr__(self) -> str:
        state = "killed" if self.is_killed() else "stopped" if self.is_stopped() else "live"
        return f"Context({self._id!r}, {state})"

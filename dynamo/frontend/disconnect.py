"""Watching a client's connection: a request whose client went away stops (its context), so that
the engine's work and every resource of the request are freed.

A unary request watches from the start (nothing is written before the end). A stream watches
only once it has waited :data:`DISCONNECT_WATCH_AFTER_S` for the engine: while its tokens flow,
its next write notices a client that left.
"""

from __future__ import annotations

import asyncio

from dynamo.frontend.exchange import Exchange
from dynamo.frontend.idle import IdleTimer
from dynamo.runtime.context import Context

DISCONNECT_WATCH_AFTER_S = 0.25
"""A stream watches its client's connection only once it has waited this long for the engine
(held in the router queue, a long prefill, a stalled worker); while its tokens flow, the next
write notices a client that left. (Chosen when granian served the frontend: its
``client_disconnect`` held the event loop 0.7-1.8 ms a call at c=64, docs/performance.md. Our own
connections resolve ``disconnected()`` from their ``connection_lost``, a future, but a watch
from the start would still cost every stream a callback and a wrapper task.)"""


class DisconnectWatch:
    """Stops ``ctx`` when the client goes away, watching the connection from the first time
    ``after_s`` seconds pass without :meth:`activity` (at once when ``after_s <= 0``).
    :meth:`cancel` when the response is done."""

    __slots__ = ("_http", "_ctx", "_timer", "_watch")

    def __init__(self, http: Exchange, ctx: Context, after_s: float) -> None:
        self._http = http
        self._ctx = ctx
        self._watch: asyncio.Future[None] | None = None
        self._timer: IdleTimer | None = None
        if after_s > 0:
            self._timer = IdleTimer(after_s, self._arm)
            self._timer.touch()
        else:
            self._arm()

    def activity(self) -> None:
        """The engine answered: the idle period starts again (until the watch is armed)."""
        if self._timer is not None:
            self._timer.touch()

    def _arm(self) -> None:
        self._timer = None
        self._watch = watch_disconnect(self._http, self._ctx)

    def done(self) -> bool:
        """Whether the client went away (as far as the watch saw)."""
        return self._watch is not None and self._watch.done()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watch is not None:
            self._watch.cancel()


def watch_disconnect(http: Exchange, ctx: Context) -> asyncio.Future[None]:
    """A future that resolves when the client goes away, stopping the request's context.
    Cancel it when the response is done."""
    watch = asyncio.ensure_future(http.disconnected())
    watch.add_done_callback(lambda f: None if f.cancelled() else ctx.stop_generating())
    return watch

"""The write-behind thread of the small HTTP server (``runtime/http_server.py``,
``write_behind=True``): responses are handed to a native sender thread that writes each
connection's dup'ed socket without the GIL, woken at most once per event loop iteration, with
optional busy polling under load. ``dynamo.runtime.sender`` (or its native build) is imported
only when a server turns write-behind on."""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dynamo.runtime.sender import Sender

BUSY_POLL_WINDOW_S = 0.01
BUSY_POLL_MIN_ITERATIONS = 100
"""Busy polling runs only after a window of BUSY_POLL_WINDOW_S in which at least this many
loop iterations answered requests (10k/s): below that rate it would mostly burn CPU."""


class Deferred(Protocol):
    """A connection that gathers its writes of a loop iteration (:meth:`WriteBehind.defer`)."""

    def flush_out(self) -> None:
        """Hand what it gathered to the sender (``sender_send``), in one piece."""
        ...


class WriteBehind:
    """A server's write-behind thread, woken at most once per event loop iteration.

    Busy polling (``busy_poll_s`` > 0): under load, after an iteration that answered requests
    the loop is kept from sleeping for ``busy_poll_s`` (a ``call_soon`` chain makes it poll
    with a zero timeout). The next request is then picked up without a wake-up of the event
    loop thread; with wrk at 16 connections this raised the slot tracker's throughput ~20 %.
    The cost is CPU: while requests keep coming within the window, the loop's core stays busy.
    """

    __slots__ = (
        "_sender",
        "_loop",
        "scheduled",
        "sender_send",
        "running",
        "_busy_poll_s",
        "_active_at",
        "_polling",
        "_window_end",
        "_window_iterations",
        "_hot",
        "_deferred",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, max_backlog_bytes: int, busy_poll_s: float = 0.0
    ) -> None:
        # Imported here: only servers with write-behind on need it (or its native build).
        from dynamo.runtime.sender import Sender

        self._sender: Sender = Sender(max_backlog_bytes=max_backlog_bytes)
        self._loop = loop
        self.scheduled = False
        self.running = True  # False once stopped: connections made later write themselves
        self._busy_poll_s = busy_poll_s
        self._active_at = 0.0
        self._polling = False
        self._window_end = 0.0
        self._window_iterations = 0
        self._hot = False
        self._deferred: list[Deferred] = []
        # The hot path calls these two directly: ``sender_send`` then, unless ``scheduled``,
        # ``schedule_flush`` (one Python frame less per response than ``send``).
        self.sender_send = self._sender.send

    def schedule_flush(self) -> None:
        self.scheduled = True
        self._loop.call_soon(self._flush)

    def defer(self, conn: Deferred) -> None:
        """``conn`` has writes gathered: its ``flush_out`` runs at this iteration's flush (so a
        response's pieces of one iteration leave in one ``send`` of the thread, not one each:
        on loopback each send runs the receiver's input path)."""
        self._deferred.append(conn)
        if not self.scheduled:
            self.schedule_flush()

    def send(self, fd: int, data: bytes) -> None:
        self._sender.send(fd, data)
        if not self.scheduled:
            self.schedule_flush()

    def shutdown_write(self, fd: int) -> None:
        self._sender.shutdown_write(fd)
        self._sender.flush()

    def close(self, fd: int) -> None:
        if not self.running:  # the thread is gone: nothing is queued for fd any more
            os.close(fd)
            return
        self._sender.close(fd)
        self._sender.flush()

    @property
    def dropped_connections(self) -> int:
        return self._sender.dropped_connections

    def _flush(self) -> None:
        self.scheduled = False
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            for conn in deferred:
                conn.flush_out()
        self._sender.flush()
        if self._busy_poll_s > 0:
            now = time.monotonic()
            self._active_at = now
            if now >= self._window_end:
                self._hot = self._window_iterations >= BUSY_POLL_MIN_ITERATIONS
                self._window_iterations = 0
                self._window_end = now + BUSY_POLL_WINDOW_S
            self._window_iterations += 1
            if self._hot and not self._polling:
                self._polling = True
                self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        if self.running and time.monotonic() - self._active_at < self._busy_poll_s:
            self._loop.call_soon(self._poll)
        else:
            self._polling = False

    def stop(self, timeout_s: float) -> None:
        self.running = False
        self._sender.stop(timeout_s)

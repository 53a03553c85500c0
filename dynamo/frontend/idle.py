"""A timer that fires after a period without activity, at the cost of a clock read per touch.

Used for the per-attempt response timeouts and for SSE keep-alive comments: both want "call me
when nothing happened for N seconds" on a path that sees thousands of events per second. One
timer handle is armed lazily: ``touch()`` only records the time; when the handle fires early (the
deadline moved) it re-arms itself at the new deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class IdleTimer:
    """Calls ``on_idle()`` once ``period`` seconds pass after the last :meth:`touch` while
    active. :meth:`pause` stops counting until the next touch; :meth:`cancel` for good.
    Single owner: the event loop's thread."""

    __slots__ = ("_loop", "_period", "_on_idle", "_last", "_active", "_handle")

    def __init__(self, period: float, on_idle: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._period = period
        self._on_idle = on_idle
        self._last = 0.0
        self._active = False
        self._handle: asyncio.TimerHandle | None = None

    def touch(self) -> None:
        """Activity now: the period starts again (and counting resumes if paused)."""
        self._last = self._loop.time()
        self._active = True
        if self._handle is None:
            self._handle = self._loop.call_at(self._last + self._period, self._fire)

    def pause(self) -> None:
        self._active = False

    def set_period(self, period: float) -> None:
        """A new period, counted from the last touch."""
        if period == self._period:
            return
        self._period = period
        if self._handle is not None and period < self._period_armed():
            self._handle.cancel()
            self._handle = self._loop.call_at(self._last + period, self._fire)

    def _period_armed(self) -> float:
        assert self._handle is not None
        return self._handle.when() - self._last

    def cancel(self) -> None:
        self._active = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        if not self._active:
            return
        due = self._last + self._period
        if self._loop.time() < due:  # touched since this handle was armed
            self._handle = self._loop.call_at(due, self._fire)
            return
        self._active = False
        self._on_idle()

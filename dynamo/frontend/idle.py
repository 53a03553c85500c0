"""A timer that fires after a period without activity, at the cost of a clock read per touch.

Used for the per-attempt response timeouts, the lazy disconnect watch, SSE keep-alive comments
and (:class:`TaskDeadline`) the request body's read deadline: each wants "call me when nothing
happened for N seconds" on a path that sees thousands of events per second, and a streamed
request has several of them. None of them arms a loop timer of its own: every active timer of a
loop is checked by one shared :class:`_Ticker` every :data:`RESOLUTION_S` while any is active (a
uvloop timer armed and cancelled costs ~3 µs plus a deferred close per request and timer; a
ticker check of a timer ~0.1 µs). So a timer fires up to one resolution after its deadline,
never before it: fine for periods of a quarter second and more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

RESOLUTION_S = 0.05
"""How often the shared ticker checks the active timers (the most a timer fires late)."""


class IdleTimer:
    """Calls ``on_idle()`` once ``period`` seconds pass after the last :meth:`touch` while
    active. :meth:`pause` stops counting until the next touch; :meth:`cancel` for good.
    Single owner: the event loop's thread."""

    __slots__ = ("_loop", "_ticker", "_period", "_on_idle", "_last", "_active", "_ticked")

    def __init__(self, period: float, on_idle: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._ticker = _ticker_of(self._loop)
        self._period = period
        self._on_idle = on_idle
        self._last = 0.0
        self._active = False
        self._ticked = False  # in the ticker's set (it drops inactive timers at its next tick)

    def touch(self) -> None:
        """Activity now: the period starts again (and counting resumes if paused)."""
        self._last = self._loop.time()
        self._active = True
        if not self._ticked:
            self._ticked = True
            self._ticker.add(self)

    def pause(self) -> None:
        self._active = False

    def set_period(self, period: float) -> None:
        """A new period, counted from the last touch."""
        self._period = period

    def cancel(self) -> None:
        self._active = False

    def _due(self, now: float) -> bool:
        return now >= self._last + self._period

    def _fire(self) -> None:
        self._active = False
        self._on_idle()


class TaskDeadline:
    """``with TaskDeadline(period):`` as ``async with asyncio.timeout(period):`` (the block's
    task is cancelled once ``period`` seconds pass, and the cancellation leaves the block as
    ``TimeoutError``), checked by the shared ticker: up to :data:`RESOLUTION_S` late, never
    early. ``asyncio.timeout`` arms and cancels a loop timer per use (~9 against ~3 µs of
    thread CPU for this); for a deadline of seconds that every request passes (the body read).
    Single owner: the task that enters it."""

    __slots__ = ("_task", "_timer", "_cancelling", "expired")

    def __init__(self, period: float) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("TaskDeadline must be used inside a task")
        self._task = task
        self._timer = IdleTimer(period, self._expire)
        self._cancelling = 0
        self.expired = False

    def __enter__(self) -> TaskDeadline:
        self._cancelling = self._task.cancelling()
        self._timer.touch()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        self._timer.cancel()
        if (
            self.expired
            and exc_type is asyncio.CancelledError
            and self._task.uncancel() <= self._cancelling
        ):
            raise TimeoutError from exc  # as asyncio.timeout: the deadline's own cancellation

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()


class _Ticker:
    """Checks a loop's active timers every :data:`RESOLUTION_S` while it has any."""

    __slots__ = ("_loop", "_timers", "_handle")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timers: set[IdleTimer] = set()
        self._handle: asyncio.TimerHandle | None = None

    def add(self, timer: IdleTimer) -> None:
        self._timers.add(timer)
        if self._handle is None:
            self._handle = self._loop.call_at(self._loop.time() + RESOLUTION_S, self._tick)

    def _tick(self) -> None:
        self._handle = None
        now = self._loop.time()
        due: list[IdleTimer] = []
        gone: list[IdleTimer] = []
        for timer in self._timers:
            if not timer._active:
                gone.append(timer)
            elif timer._due(now):
                due.append(timer)
        for timer in gone + due:
            timer._ticked = False
            self._timers.discard(timer)
        if self._timers:
            self._handle = self._loop.call_at(now + RESOLUTION_S, self._tick)
        for timer in due:
            if timer._active:  # an earlier callback of this tick may have cancelled it
                timer._fire()


_current: tuple[asyncio.AbstractEventLoop, _Ticker] | None = None


def _ticker_of(loop: asyncio.AbstractEventLoop) -> _Ticker:
    """The ticker of ``loop`` (one per loop; a new loop, e.g. a test's, gets a new one)."""
    global _current
    if _current is None or _current[0] is not loop:
        _current = (loop, _Ticker(loop))
    return _current[1]

"""IdleTimer: fires once a period passes without a touch (never before, at most one ticker
resolution after), not while paused or after cancel, and many timers share one loop timer."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.frontend.idle import RESOLUTION_S, IdleTimer

pytestmark = pytest.mark.unit


async def test_fires_after_the_period_without_touches_never_before() -> None:
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    # touches 0.05 s apart keep it from firing even if a loaded machine stalls the test for
    # 0.25 s between two of them (0.08 s apart with a 0.15 s period, a 70 ms stall fired it)
    period = 0.3
    timer = IdleTimer(period, lambda: fired.append(loop.time()))
    timer.touch()
    for _ in range(8):  # touches keep it from firing, over more than the period
        await asyncio.sleep(0.05)
        timer.touch()
    last = loop.time()
    await asyncio.sleep(period + 4 * RESOLUTION_S)
    assert len(fired) == 1
    assert fired[0] >= last + period
    await asyncio.sleep(0.2)
    assert len(fired) == 1  # once, until touched again
    timer.touch()
    await asyncio.sleep(period + 4 * RESOLUTION_S)
    assert len(fired) == 2


async def test_pause_cancel_and_a_shorter_period() -> None:
    fired: list[str] = []
    paused = IdleTimer(0.05, lambda: fired.append("paused"))
    cancelled = IdleTimer(0.05, lambda: fired.append("cancelled"))
    shortened = IdleTimer(600.0, lambda: fired.append("shortened"))
    for timer in (paused, cancelled, shortened):
        timer.touch()
    paused.pause()
    cancelled.cancel()
    shortened.set_period(0.05)  # counted from the last touch
    await asyncio.sleep(0.05 + 4 * RESOLUTION_S)
    assert fired == ["shortened"]


async def test_many_timers_share_one_loop_timer() -> None:
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_at = loop.call_at

    def counting_call_at(when, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        armed.append(when)
        return call_at(when, callback, *args, **kwargs)

    loop.call_at = counting_call_at  # type: ignore[method-assign]
    try:
        fired: list[int] = []
        timers = [IdleTimer(0.05, lambda i=i: fired.append(i)) for i in range(100)]
        for timer in timers:
            timer.touch()
        await asyncio.sleep(0.05 + 4 * RESOLUTION_S)
    finally:
        del loop.call_at
    assert sorted(fired) == list(range(100))
    assert len(armed) <= 6  # the ticker's ticks, not one timer per IdleTimer

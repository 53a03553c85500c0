"""The step loop paces passes against absolute deadlines: its own overhead never accumulates.

A fake clock whose every sleep wakes late (like an event loop's timer granularity) and a load
sink that spends clock time on every pass (like step() and delivery costing CPU) stand in for a
real machine; the mean decode interval must still equal the model's.
"""

from __future__ import annotations

import pytest
from mocker_sim import make_request

from dynamo.mocker.config import MockerConfig
from dynamo.mocker.engine import MockerEngine
from dynamo.mocker.timing import (
    MAX_PASS_LAG_S,
    VirtualClock,
    decode_ms,
    pass_sleep,
    pass_start,
    prefill_ms,
)
from dynamo.protocol.load import WorkerLoad
from dynamo.runtime.context import Context

OVERSHOOT_S = 0.0007  # every sleep wakes this late
PASS_COST_S = 0.0002  # clock time the loop spends around every pass
TOTAL = 16384 * 64


class LateClock(VirtualClock):
    """A virtual clock whose sleeps always overshoot by ``OVERSHOOT_S``."""

    async def sleep(self, seconds: float) -> None:
        await super().sleep(max(0.0, seconds) + OVERSHOOT_S)


async def token_times(isl: int, osl: int, clock: LateClock) -> list[float]:
    async def costly_sink(_load: WorkerLoad) -> None:
        clock.advance(PASS_COST_S)

    engine = MockerEngine(MockerConfig(), clock=clock, load_sink=costly_sink)
    await engine.start(1)
    try:
        times: list[float] = []
        async for out in engine.generate(make_request(isl, osl), Context()):
            times.extend([clock.now()] * len(out.token_ids))
        return times
    finally:
        await engine.cleanup()


async def test_mean_decode_interval_equals_the_model_despite_loop_overhead() -> None:
    clock = LateClock()
    isl, osl = 1024, 64
    times = await token_times(isl, osl, clock)
    assert len(times) == osl
    itl = [b - a for a, b in zip(times, times[1:], strict=False)]
    model = [decode_ms(isl + i, TOTAL) / 1000 for i in range(1, osl)]
    mean, model_mean = sum(itl) / len(itl), sum(model) / len(model)
    assert mean == pytest.approx(model_mean, rel=0.01)
    # No accumulation: the last token is where the model puts it, within one pass's loop cost
    # (the consumer reads the clock before or after the loop spends it); the old loop was late
    # by (overshoot + cost) per pass, 57 ms here.
    assert times[-1] - times[0] == pytest.approx(sum(model), abs=PASS_COST_S * 1.01)
    assert itl == [pytest.approx(m, abs=PASS_COST_S * 1.01) for m in model]
    # The first token is late by one wake-up only, not by one per pass.
    first = prefill_ms(isl) / 1000 + OVERSHOOT_S
    assert first <= times[0] <= first + 3 * PASS_COST_S


async def test_after_idle_the_schedule_restarts_from_now() -> None:
    clock = LateClock()
    await token_times(1024, 2, clock)
    clock.advance(5.0)  # idle: the next request must not inherit the old deadline
    begin = clock.now()
    times = await token_times(1024, 2, clock)
    assert times[0] - begin >= prefill_ms(1024) / 1000


def test_pass_start_rules() -> None:
    # Idle: start now, or when the request that woke the loop arrived (not at the wake-up).
    assert pass_start(10.0, None, None) == 10.0
    assert pass_start(10.001, None, 10.0) == 10.0
    assert pass_start(10.0 + MAX_PASS_LAG_S * 2, None, 10.0) == 10.0 + MAX_PASS_LAG_S * 2
    # Busy and woke late: start at the previous pass's end.
    assert pass_start(10.001, 10.0, None) == 10.0
    # Never before an arrival the pass includes, never after now.
    assert pass_start(10.001, 10.0, 10.0005) == 10.0005
    assert pass_start(10.001, 10.0, 10.002) == 10.001
    # Starved for longer than the allowed lag: restart from now (no burst of back-dated passes).
    assert pass_start(10.0 + MAX_PASS_LAG_S * 2, 10.0, None) == 10.0 + MAX_PASS_LAG_S * 2
    # Woke early (a clock that returns early): never start in the future.
    assert pass_start(9.999, 10.0, None) == 9.999


def test_a_late_loop_catches_up_without_back_to_back_passes() -> None:
    # On schedule: sleep until the pass's end.
    assert pass_sleep(10.0, 10.006, 0.006) == pytest.approx(0.006)
    # 5 ms late for a 6 ms pass: sleep half the pass, not 1 ms (tokens would coalesce).
    assert pass_sleep(10.005, 10.006, 0.006) == pytest.approx(0.003)
    # A pass shorter than two timer ticks (a high speedup) behind schedule: no sleep at all.
    assert pass_sleep(10.001, 10.0006, 0.0006) == 0.0
    assert pass_sleep(10.0, 10.0006, 0.0006) == pytest.approx(0.0006)


async def test_a_high_speedup_keeps_the_model_pace_despite_timer_ticks() -> None:
    class TickClock(VirtualClock):
        """Sleeps last whole milliseconds (rounded up), like epoll."""

        async def sleep(self, seconds: float) -> None:
            ticks = -(-max(0.0, seconds) // 0.001)
            await super().sleep(ticks * 0.001)

    clock = TickClock()
    engine = MockerEngine(MockerConfig(speedup_ratio=20), clock=clock)
    await engine.start(1)
    try:
        times: list[float] = []
        async for out in engine.generate(make_request(1024, 201), Context()):
            times.extend([clock.now()] * len(out.token_ids))
    finally:
        await engine.cleanup()
    model = sum(decode_ms(1024 + i, TOTAL) for i in range(1, 201)) / 200 / 20 / 1000
    assert (times[-1] - times[0]) / 200 == pytest.approx(model, rel=0.02)

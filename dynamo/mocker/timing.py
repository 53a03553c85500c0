"""The mocker's timing model (FACTS §6.4) and the injectable clock it runs on.

Durations are pure functions of what a forward pass contains; clocks decide whether time passes
for real (``RealClock``) or only on paper (``VirtualClock``: tests, offline replay).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Protocol

# Polynomial model of the reference mocker (lib/mocker/src/common/perf_model.rs).
_P2, _P1, _P0 = 4.209989e-07, 1.518344e-02, 1.650142e01
_D2, _D1, _D0 = -25.74, 54.01, 5.74


def prefill_ms(num_new_tokens: int) -> float:
    """Prefill cost of one pass: T = new (uncached) tokens summed over the batch; 0 if T = 0."""
    if num_new_tokens <= 0:
        return 0.0
    t = float(num_new_tokens)
    return _P2 * t * t + _P1 * t + _P0


def decode_ms(active_kv_tokens: int, total_kv_tokens: int) -> float:
    """Decode cost of one pass: u = context tokens of the decode set / KV capacity in tokens."""
    u = active_kv_tokens / total_kv_tokens if total_kv_tokens > 0 else 1.0
    return max(1.0, _D2 * u * u + _D1 * u + _D0)


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Wall-clock seconds of passes and transfers, after the speedup ratios.

    ``speedup_ratio == 0`` means infinitely fast: every duration is 0 (no sleeping at all).
    KV transfer is charged only when both bandwidth (GB/s) and bytes per token are set and > 0.
    """

    total_kv_tokens: int
    speedup_ratio: float = 1.0
    decode_speedup_ratio: float = 1.0
    kv_transfer_bandwidth: float | None = None
    kv_bytes_per_token: int | None = None

    def pass_ms(self, prefill_tokens: int, decode_context_tokens: int, num_decodes: int) -> float:
        """Simulated (unscaled) milliseconds of one pass: prefill part + decode part."""
        total = prefill_ms(prefill_tokens)
        if num_decodes > 0:
            total += decode_ms(decode_context_tokens, self.total_kv_tokens)
        return total

    def pass_seconds(
        self, prefill_tokens: int, decode_context_tokens: int, num_decodes: int
    ) -> float:
        """Seconds one pass takes on the clock (decode part also / decode_speedup_ratio)."""
        speedup = self.speedup_ratio
        if speedup == 0:
            return 0.0
        total = prefill_ms(prefill_tokens)
        if num_decodes > 0:
            total += (
                decode_ms(decode_context_tokens, self.total_kv_tokens) / self.decode_speedup_ratio
            )
        return total / speedup / 1000.0

    def transfer_seconds(self, num_prompt_tokens: int) -> float:
        """KV transfer time of a remote prefill (``full_prompt`` mode), after speedup."""
        bw, per_token = self.kv_transfer_bandwidth, self.kv_bytes_per_token
        if self.speedup_ratio == 0 or not bw or not per_token:
            return 0.0
        return num_prompt_tokens * per_token / (bw * 1e9) / self.speedup_ratio


MAX_PASS_LAG_S = 0.5
"""How far behind its schedule the step loop may run and still catch up (a GPU keeps computing
while the host is descheduled; catching up is at most 2x fast, see ``MIN_SLEEP_FRACTION``). A
loop starved for longer (a blocked event loop) restarts its schedule from now instead."""


def pass_start(now: float, previous_end: float | None, latest_arrival: float | None) -> float:
    """When the next pass starts, on the clock.

    A busy loop runs passes back to back: the next one starts where the previous ended
    (``previous_end``), even if the loop woke a little late, so the mean pass time equals the
    model's and sleep overshoot or the loop's own CPU time never accumulate. After an idle
    period (``previous_end`` None) it starts when the newest request it includes arrived (the
    loop's wake-up is not the engine's time either). It never starts before a request it
    includes arrived, nor more than ``MAX_PASS_LAG_S`` in the past, nor in the future.
    """
    if previous_end is None or now - previous_end > MAX_PASS_LAG_S:
        if latest_arrival is not None and 0.0 <= now - latest_arrival <= MAX_PASS_LAG_S:
            return latest_arrival
        return now
    start = min(now, previous_end)
    if latest_arrival is not None and latest_arrival > start:
        start = min(now, latest_arrival)
    return start


MIN_SLEEP_FRACTION = 0.5
"""A pass that catches up still sleeps at least this fraction of its duration, so that the
tokens of consecutive passes do not leave back to back (they would coalesce into one chunk)..."""
TIMER_GRANULARITY_S = 0.001
"""... unless that is shorter than an event-loop timer can sleep (epoll and libuv wake up in
whole milliseconds): then a pass behind schedule does not sleep at all, which is how a loop at a
high speedup keeps the model's pace with passes shorter than a timer tick."""


def pass_sleep(now: float, end: float, duration: float) -> float:
    """How long to sleep for a pass that ends at ``end`` on the schedule: until then, but at
    least ``MIN_SLEEP_FRACTION`` of its ``duration`` when that is a sleep a timer can do (a late
    loop catches up over a few passes)."""
    floor = duration * MIN_SLEEP_FRACTION
    return max(end - now, floor if floor >= TIMER_GRANULARITY_S else 0.0)


class Clock(Protocol):
    """Time source of the mocker: ``now()`` in seconds, ``sleep`` lets that much time pass."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """The event loop's monotonic time and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class VirtualClock:
    """Simulated time. Synchronous drivers move it with ``advance``/``advance_to``.

    Async sleepers form a discrete-event queue: ``sleep(d)`` registers a wake-up at ``now + d``;
    once the loop has given every ready task a turn, the earliest wake-up is taken, the clock jumps
    to it and that sleeper resumes. Several sleepers (e.g. one per DP rank) therefore overlap in
    simulated time instead of adding up. Must be used from one event loop.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._counter = itertools.count()
        self._pump_pending = False

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._now += seconds

    def advance_to(self, when: float) -> None:
        """Move to ``when`` (no-op if it is in the past)."""
        self._now = max(self._now, when)

    async def sleep(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._timers, (self._now + seconds, next(self._counter), fut))
        if not self._pump_pending:
            self._pump_pending = True
            # Two hops: let tasks made ready in this iteration register their sleeps first.
            loop.call_soon(loop.call_soon, self._fire_next)
        await fut

    def _fire_next(self) -> None:
        self._pump_pending = False
        while self._timers:
            wake, _, fut = heapq.heappop(self._timers)
            if fut.done():  # the sleeper was cancelled
                continue
            self._now = max(self._now, wake)
            fut.set_result(None)
            break
        if self._timers:
            self._pump_pending = True
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self._fire_next)

"""Load loops: closed loop (N concurrent senders, each starting its next request when the
previous one ends) and open loop (sessions start at Poisson arrivals or at the times a trace
prescribes, however many are in flight). Plus the stderr progress bar.

All tasks are owned by :class:`LoadRunner.run`, named, and awaited (or cancelled) before it
returns.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

from dynamo.bench.request import RequestRecord, RequestSpec
from dynamo.bench.workload import Session


@dataclass(slots=True)
class Budget:
    """How many more requests may start: a count limit and/or a deadline (perf_counter)."""

    limit: int | None
    deadline: float | None = None
    issued: int = 0

    def exhausted(self) -> bool:
        if self.limit is not None and self.issued >= self.limit:
            return True
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def take(self) -> bool:
        if self.exhausted():
            return False
        self.issued += 1
        return True


class Progress:
    """A one-line progress bar on stderr, redrawn at most every ``interval`` seconds."""

    def __init__(
        self,
        *,
        label: str,
        total: int | None,
        duration_s: float | None,
        enabled: bool,
        stream: TextIO | None = None,
        interval: float = 0.2,
    ) -> None:
        self._label = label
        self._total = total
        self._duration = duration_s
        self._enabled = enabled
        self._stream = stream or sys.stderr
        self._interval = interval
        self._done = 0
        self._errors = 0
        self._started = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def record(self, record: RequestRecord) -> None:
        self._done += 1
        self._errors += record.error is not None

    def start(self) -> None:
        self._started = time.perf_counter()
        if self._enabled:
            self._task = asyncio.create_task(self._redraw(), name=f"bench-progress-{self._label}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
            self._draw()
            self._stream.write("\n")
            self._stream.flush()

    async def _redraw(self) -> None:
        while True:
            self._draw()
            await asyncio.sleep(self._interval)

    def line(self) -> str:
        elapsed = time.perf_counter() - self._started
        fraction: float | None = None
        if self._total:
            fraction = self._done / self._total
        if self._duration:
            by_time = elapsed / self._duration
            fraction = by_time if fraction is None else max(fraction, by_time)
        width = 24
        if fraction is None:
            bar = ""
        else:
            fraction = min(1.0, fraction)
            filled = int(fraction * width)
            bar = f"[{'#' * filled}{'.' * (width - filled)}] {fraction * 100:3.0f}% "
        count = f"{self._done}/{self._total}" if self._total else f"{self._done}"
        rate = self._done / elapsed if elapsed > 0 else 0.0
        return (
            f"{self._label} {bar}{count} req | {rate:7.1f} req/s | "
            f"errors {self._errors} | {elapsed:6.1f} s"
        )

    def _draw(self) -> None:
        self._stream.write("\r" + self.line())
        self._stream.flush()


@dataclass(slots=True)
class LoadRunner:
    """Runs sessions against ``send`` and collects every record (in completion order).

    Closed loop when ``rate`` is None and sessions carry no arrival times: ``concurrency``
    workers. Open loop otherwise: a session starts at its ``arrival`` or at the next Poisson
    arrival of ``rate`` per second; ``max_concurrency`` (if set) caps requests in flight, and
    a request's timing starts when it is sent, not while it waits for that cap.
    """

    send: Callable[[RequestSpec], Awaitable[RequestRecord]]
    budget: Budget
    concurrency: int = 1
    rate: float | None = None
    max_concurrency: int | None = None
    think_time_s: float = 0.0
    seed: int = 0
    progress: Progress | None = None
    records: list[RequestRecord] = field(default_factory=list)
    _limit: asyncio.Semaphore | None = None

    async def run(self, sessions: Iterable[Session], *, open_loop: bool) -> list[RequestRecord]:
        if self.max_concurrency is not None:
            self._limit = asyncio.Semaphore(self.max_concurrency)
        if self.progress is not None:
            self.progress.start()
        try:
            if open_loop:
                await self._open(iter(sessions))
            else:
                await self._closed(iter(sessions))
        finally:
            if self.progress is not None:
                await self.progress.stop()
        return self.records

    async def _closed(self, sessions: Iterator[Session]) -> None:
        async def worker() -> None:
            for session in sessions:
                if not await self._session(session, taken=False):
                    return

        workers = [
            asyncio.create_task(worker(), name=f"bench-worker-{i}") for i in range(self.concurrency)
        ]
        await _gather_owned(workers)

    async def _open(self, sessions: Iterator[Session]) -> None:
        loop = asyncio.get_running_loop()
        rng = random.Random(self.seed ^ 0xA77)
        started = loop.time()
        started_perf = time.perf_counter()  # the budget's clock
        poisson_at = 0.0
        tasks: set[asyncio.Task[bool]] = set()
        try:
            for index, session in enumerate(sessions):
                arrival = session.arrival
                if arrival is None:
                    if self.rate is None:
                        raise ValueError("an open loop without a trace needs a rate")
                    arrival = poisson_at
                    poisson_at += rng.expovariate(self.rate)
                deadline = self.budget.deadline
                if deadline is not None and started_perf + arrival >= deadline:
                    break  # the next arrival falls after the duration
                delay = started + arrival - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not self.budget.take():
                    break
                task = asyncio.create_task(
                    self._session(session, taken=True), name=f"bench-session-{index}"
                )
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            await _gather_owned(list(tasks))

    async def _session(self, session: Session, *, taken: bool) -> bool:
        """Run one session's requests in order; False once the budget is exhausted."""
        previous: RequestRecord | None = None
        while True:
            spec = session.next(previous)
            if spec is None:
                return True
            if previous is not None and self.think_time_s > 0:
                await asyncio.sleep(self.think_time_s)
            if not taken and not self.budget.take():
                return False
            taken = False
            if self._limit is not None:
                async with self._limit:
                    record = await self.send(spec)
            else:
                record = await self.send(spec)
            self.records.append(record)
            if self.progress is not None:
                self.progress.record(record)
            previous = record


async def _gather_owned(tasks: list[asyncio.Task[None]] | list[asyncio.Task[bool]]) -> None:
    """Await every task; on cancellation or error cancel the rest and wait for them too."""
    if not tasks:
        return
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

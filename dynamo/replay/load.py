"""The replay's load generation: ``dynamo bench``'s load loops on the virtual clock.

Closed loop: ``concurrency`` runners, each sending its session's next request when the previous
one ended (plus think time) and taking a new session when its session ends. Open loop: each
session starts at its arrival (the trace's timestamp, or a Poisson process at ``rate``), one
runner per session, with ``max_concurrency`` capping the requests in flight (the rest queue,
FIFO). The budget (``limit`` requests, ``duration_s`` of simulated time) is taken when a request
(open loop: a session) starts, as ``dynamo bench``'s ``Budget``.

``LoadGenerator`` decides *when* and *what* to send; the simulator owns the clock and the event
heap (``schedule``: run ``wake(runner)`` at a time) and sends (``send``).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dynamo.bench.request import RequestRecord, RequestSpec
from dynamo.bench.workload import Session, SingleRequest


@dataclass(slots=True)
class LoadSpec:
    """How requests are offered: closed loop (``concurrency`` runners) unless ``rate`` is set
    or sessions carry arrival times (open loop). ``limit``: most requests (None: until the
    sessions or ``duration_s`` end). ``max_concurrency`` caps requests in flight (open loop).
    ``timeout_s``: a request not finished this long after it was sent is abandoned (the
    client gives up, as ``dynamo bench --request-timeout``; None: never)."""

    concurrency: int = 1
    rate: float | None = None
    open_loop: bool = False
    max_concurrency: int | None = None
    limit: int | None = 100
    duration_s: float | None = None
    think_time_s: float = 0.0
    seed: int = 0
    timeout_s: float | None = None


@dataclass(slots=True, eq=False)
class Runner:
    """A closed-loop concurrency slot or an open-loop session: sends one request at a time."""

    session: Session | None
    previous: RequestRecord | None = None
    taken: bool = False  # the budget was taken for the next request already (open loop)
    pending: RequestSpec | None = None  # drawn, waiting out the think time
    pulls: bool = True  # takes a new session when its session ends (closed loop)


Schedule = Callable[[float, "Runner | None"], None]
"""``schedule(when, runner)``: call ``LoadGenerator.wake(runner)`` at simulated ``when`` (ties
in call order); ``runner`` None is the open loop's next arrival."""
Send = Callable[[RequestSpec, Runner, "LoadGenerator"], None]
"""``send(spec, runner, generator)``: send ``runner``'s request now; ``generator`` (the phase
sending it) hears of its end (``ended``). Passed, not closed over: no reference cycle."""


class LoadGenerator:
    """One phase of load (the warm-up, or the measured run) on ``sessions``."""

    def __init__(
        self,
        load: LoadSpec,
        sessions: Iterator[Session],
        *,
        clock: Callable[[], float],
        schedule: Schedule,
        send: Send,
        origin: float = 0.0,
    ) -> None:
        self.load = load
        self._sessions = sessions
        self._clock = clock
        self._schedule = schedule
        self._send = send
        self._origin = origin  # arrival times and the duration count from here
        self._issued = 0
        self._stopped = False  # the budget ran out: no new sessions
        self.in_flight = 0
        self._queued: deque[tuple[RequestSpec, Runner]] = deque()
        self._poisson = random.Random(load.seed ^ 0xA77)
        self._poisson_at = 0.0

    def start(self) -> None:
        """Schedule the first sends at the origin."""
        if self.load.open_loop:
            self._schedule(self._origin, None)  # the first open-loop tick
        else:
            for _ in range(self.load.concurrency):
                self._schedule(self._origin, Runner(None))

    def wake(self, runner: Runner | None) -> None:
        """A scheduled send is due (``runner`` None: the open loop's next arrival)."""
        if runner is None:
            self._open_tick()
        else:
            self._advance(runner)

    def waker(self) -> Callable[[Any], None]:
        """The handler of this phase's scheduled sends: ``wake``, or for a closed loop (whose
        sends are all runners') ``wake``'s runner branch itself (a call fewer a request)."""
        return self.wake if self.load.open_loop else self._advance

    def ended(self, runner: Runner, record: RequestRecord, now: float) -> None:
        """A request of ``runner`` ended (done or failed) at ``now``: its runner goes on, and
        a request queued by ``max_concurrency`` starts."""
        self.in_flight -= 1
        runner.previous = record
        self._schedule(now, runner)
        cap = self.load.max_concurrency
        if self._queued and (cap is None or self.in_flight < cap):
            spec, queued = self._queued.popleft()
            self._dispatch(spec, queued)

    def _take(self) -> bool:
        """One more request may start (count limit and simulated deadline)."""
        load = self.load
        if self._stopped or (load.limit is not None and self._issued >= load.limit):
            self._stopped = True
            return False
        if load.duration_s is not None and self._clock() - self._origin >= load.duration_s:
            self._stopped = True
            return False
        self._issued += 1
        return True

    def _open_tick(self) -> None:
        """Open loop: schedule the next session's start at its arrival (lazily, one ahead)."""
        if self._stopped:
            return
        session = next(self._sessions, None)
        if session is None:
            return
        arrival = session.arrival
        if arrival is None:
            if self.load.rate is None:
                raise ValueError("an open loop without a trace needs a rate")
            arrival = self._poisson_at
            self._poisson_at += self._poisson.expovariate(self.load.rate)
        if self.load.duration_s is not None and arrival >= self.load.duration_s:
            return
        when = max(self._origin + arrival, self._clock())
        self._schedule(when, Runner(session, pulls=False))
        self._schedule(when, None)

    def _advance(self, runner: Runner) -> None:
        """The runner's next request (or session): send it now, after think time, or stop."""
        load = self.load
        if not runner.pulls and runner.session is not None and runner.previous is None:
            if not runner.taken:  # an open-loop session starting: it takes the budget now
                if not self._take():
                    return
                runner.taken = True
        spec = runner.pending
        runner.pending = None
        while spec is None:
            session = runner.session
            if session is None:
                if not runner.pulls or self._stopped:
                    return
                session = runner.session = next(self._sessions, None)
                runner.previous = None
                if session is None:
                    return
            if type(session) is SingleRequest:  # its one request: next() read from its fields,
                spec = None if session.sent else session.spec  # and the session ends now (no
                session.sent = True  # second call to find it done: a frame a request)
                runner.session = None
            else:
                spec = session.next(runner.previous)
                if spec is None:
                    runner.session = None
            if spec is None:
                continue
            if runner.previous is not None and load.think_time_s > 0:
                runner.pending = spec
                self._schedule(self._clock() + load.think_time_s, runner)
                return
        if not runner.taken and not self._take():
            return
        runner.taken = False
        cap = load.max_concurrency
        if cap is not None and self.in_flight >= cap:
            self._queued.append((spec, runner))
            return
        self.in_flight += 1  # _dispatch's body (a call fewer a request)
        self._send(spec, runner, self)

    def _dispatch(self, spec: RequestSpec, runner: Runner) -> None:
        self.in_flight += 1
        self._send(spec, runner, self)

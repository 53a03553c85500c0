"""Test helpers: build requests and drive a mocker ``Scheduler`` on simulated time."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo.mocker.config import MockerConfig
from dynamo.mocker.simulator import MockerScheduler as Scheduler
from dynamo.mocker.timing import VirtualClock
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.output import FinishReason
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from tests.unit.engine_core.block_set import BlockSetSubscriber


def make_request(
    tokens: list[int] | int,
    max_tokens: int | None = 4,
    *,
    min_tokens: int | None = None,
    stop_token_ids: list[int] | None = None,
    eos_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    prefill_result: DisaggregatedParams | None = None,
    start: int = 1,
) -> PreprocessedRequest:
    ids = list(range(start, start + tokens)) if isinstance(tokens, int) else tokens
    return PreprocessedRequest(
        model="mock",
        token_ids=ids,
        stop=StopConditions(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids or [],
            ignore_eos=ignore_eos,
        ),
        eos_token_ids=eos_token_ids or [],
        prefill_result=prefill_result,
    )


@dataclass
class Trace:
    """What one request saw: arrival, token emission times, tokens, finish."""

    arrival: float
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    cached_tokens: int | None = None

    @property
    def ttft_ms(self) -> float:
        return (self.times[0] - self.arrival) * 1000

    @property
    def itls_ms(self) -> list[float]:
        return [(b - a) * 1000 for a, b in zip(self.times, self.times[1:], strict=False)]


def simulate(
    sched: Scheduler,
    arrivals: list[tuple[float, str, PreprocessedRequest]],
    *,
    check: bool = True,
    max_steps: int = 1_000_000,
    on_step: Callable[[Scheduler, float], None] | None = None,
    subscriber: BlockSetSubscriber | None = None,
) -> dict[str, Trace]:
    """Run on a ``VirtualClock`` until every request finished (or was aborted by ``on_step``).
    Requests arriving during a pass join the next one. Invariants are checked after every pass,
    and the ``subscriber`` (if given) must always match the KV manager."""
    queue = [(t, i, rid, req) for i, (t, rid, req) in enumerate(arrivals)]
    heapq.heapify(queue)
    traces: dict[str, Trace] = {}
    clock = VirtualClock()
    for _ in range(max_steps):
        now = clock.now()
        while queue and queue[0][0] <= now:
            t, _, rid, req = heapq.heappop(queue)
            traces[rid] = Trace(arrival=t)
            sched.add_request(req, rid, now)
        if not queue and not sched.has_work:
            return traces
        out = sched.step(now)
        if check:
            sched.check_invariants()
        if subscriber is not None:
            subscriber.apply(out.events)
            assert subscriber.blocks == sched.kv.cached_blocks()
        if on_step is not None:
            on_step(sched, now)
            if check:
                sched.check_invariants()
        if out.is_empty:
            candidates = [queue[0][0]] if queue else []
            ready = sched.next_ready_at()
            if ready is not None:
                candidates.append(ready)
            if not candidates:
                assert not sched.has_work, "stuck: work but nothing runnable and nothing to await"
                continue
            clock.advance_to(min(candidates))
            continue
        clock.advance(out.duration)
        now = clock.now()
        for seq, token in out.tokens:
            tr = traces[seq.request_id]
            tr.times.append(now)
            tr.tokens.append(token)
        for seq in out.finished:
            traces[seq.request_id].finish = seq.finish_reason
            traces[seq.request_id].cached_tokens = seq.num_cached_tokens
    raise AssertionError("simulation did not finish")


def scheduler(**overrides: object) -> Scheduler:
    return Scheduler(MockerConfig(**overrides))  # type: ignore[arg-type]

"""``MockerEngine``: the mocker as an ``LLMEngine``. One step-loop task per DP rank owns that
rank's scheduler and KV pool; requests reach it through an inbox and leave through per-request
collectors that coalesce tokens when the consumer is slow (the loop never waits on a consumer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from dynamo.backend.capabilities import check_request
from dynamo.backend.engine import (
    DisaggCounters,
    EngineConfig,
    GenerateContext,
    LLMEngine,
    RankMetrics,
)
from dynamo.engine_core.sequence import Sequence, sequence_from_request
from dynamo.mocker import pass_log
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.load_publisher import LoadPublisher, LoadSink
from dynamo.mocker.logprobs import CAPABILITIES, MockLogprobs
from dynamo.mocker.simulator import MockerScheduler, StepOutput
from dynamo.mocker.timing import Clock, RealClock, pass_sleep, pass_start
from dynamo.observability.engine_metrics import HitRateWindow
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.kv_events import KVEventBatch
from dynamo.protocol.output import FinishReason, LLMEngineOutput, Usage
from dynamo.protocol.request import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo.runtime.context import Context
from dynamo.runtime.errors import DynamoError, EngineShutdown, InvalidArgument

log = logging.getLogger(__name__)

SPEEDUP0_SLICE_S = 0.0005
"""The longest the step loop works before letting consumers run when it does not pace passes:
at speedup 0, and on a real clock while its passes are overdue (behind the model's schedule)."""

KVEventSink = Callable[[KVEventBatch], Awaitable[None]]
"""Receives each pass's KV events of one rank, in order (the worker publishes them)."""


class _Collector:
    """Outputs of one request, from the step loop to its ``generate`` consumer. Tokens pile up
    while the consumer is busy and are taken all at once (coalescing)."""

    __slots__ = ("tokens", "terminal", "error", "done", "cancelled", "stopped", "waiter")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.terminal: LLMEngineOutput | None = None
        self.error: DynamoError | None = None
        self.done = False  # the scheduler no longer knows the request
        self.cancelled = False  # abort(ctx) freed it: end with a cancelled terminal
        # the request's context stopped (set by its ``on_stop`` callback, which runs at once if
        # it had already: the consumer reads a flag per output instead of calling is_stopped())
        self.stopped = False
        self.waiter: asyncio.Future[None] | None = None  # set while the consumer waits

    def wake(self, _ctx: Context | None = None) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def stop(self, _ctx: Context) -> None:
        self.stopped = True
        self.wake()


@dataclass(slots=True)
class _Rank:
    """One DP rank: its scheduler, the inbox its loop drains, and the live collectors."""

    index: int
    scheduler: MockerScheduler
    inbox: list[tuple[Sequence | None, str]] = field(default_factory=list)
    collectors: dict[str, _Collector] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    load: LoadPublisher | None = None  # None: the engine has no load sink
    next_yield: float = 0.0
    hit_rate: HitRateWindow = field(default_factory=HitRateWindow)
    disagg: DisaggCounters = field(default_factory=DisaggCounters)


class MockerEngine(LLMEngine):
    """A simulated vLLM-like engine (FACTS §6). See ``LLMEngine`` for the lifecycle contract.

    ``request.routing.dp_rank`` picks the rank (else the one with the fewest live requests).
    KV events and load go to the optional sinks, awaited by the step loop once per pass, in order;
    a sink must not block for long (queue and publish elsewhere if needed).
    """

    def __init__(
        self,
        config: MockerConfig,
        *,
        clock: Clock | None = None,
        kv_event_sink: KVEventSink | None = None,
        load_sink: LoadSink | None = None,
    ) -> None:
        self.config = config
        self.clock: Clock = clock or RealClock()
        self.kv_event_sink = kv_event_sink
        self.load_sink = load_sink
        self.worker_id: int | None = None
        self._ranks: list[_Rank] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._keys = itertools.count()
        self._ctx_keys: dict[str, set[str]] = {}
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, worker_id: int) -> EngineConfig:
        cfg = self.config
        if self._tasks:
            raise RuntimeError("MockerEngine.start() called twice")
        self.worker_id = worker_id
        if cfg.startup_time:
            await self.clock.sleep(cfg.startup_time)  # simulated model load
        self._ranks = [self._new_rank(r) for r in range(cfg.data_parallel_size)]
        self._tasks = [
            asyncio.create_task(self._step_loop(rank), name=f"mocker-step:{worker_id:x}:{r}")
            for r, rank in enumerate(self._ranks)
        ]
        return EngineConfig(
            model=cfg.model_path or cfg.served_model_name,
            served_model_name=cfg.served_model_name,
            context_length=cfg.max_model_len,
            kv_block_size=cfg.block_size,
            total_kv_blocks=cfg.num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            data_parallel_size=cfg.data_parallel_size,
            capabilities=CAPABILITIES,
        )

    def _new_rank(self, index: int) -> _Rank:
        scheduler = MockerScheduler(self.config, dp_rank=index)
        rank = _Rank(index, scheduler)
        if self.load_sink is not None:
            current = functools.partial(scheduler.load, self.worker_id or 0)
            rank.load = LoadPublisher(self.load_sink, self.clock, current, index)
        return rank

    async def drain(self) -> None:
        """Called after the grace period: refuse new requests and fail those still in flight."""
        self._closed = True
        self._fail_all(EngineShutdown("the mocker is shutting down"))

    async def cleanup(self) -> None:
        """Stop the step loops and end every open stream. Idempotent; safe before start()."""
        self._closed = True
        tasks, self._tasks = self._tasks, []
        tasks += [r.load.flush_task for r in self._ranks if r.load and r.load.flush_task]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._fail_all(EngineShutdown("the mocker was cleaned up"))

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self, request: PreprocessedRequest, ctx: GenerateContext
    ) -> AsyncGenerator[LLMEngineOutput, None]:
        if self._closed or not self._tasks:
            raise EngineShutdown("the mocker is not running")
        rank = self._pick_rank(request)
        check_request(request, CAPABILITIES)
        key = f"{ctx.id}#{next(self._keys)}"
        seed_id = request.request_id or ctx.id
        seq = sequence_from_request(self.config, request, key, self.clock.now(), seed_id=seed_id)
        lp = MockLogprobs.for_request(self.config, request, seed_id)  # None unless asked
        col = _Collector()
        rank.collectors[key] = col
        self._ctx_keys.setdefault(ctx.id, set()).add(key)
        rank.inbox.append((seq, key))
        rank.wake.set()
        remove_monitor = ctx.on_stop(col.stop)
        loop = asyncio.get_running_loop()
        n_out = 0
        try:
            while True:
                if (col.cancelled or col.stopped) and col.terminal is None:
                    n_out += len(col.tokens)
                    out = _terminal(FinishReason.CANCELLED, col.tokens, seq, n_out)
                    yield out if lp is None else lp.annotate(out)
                    return
                if col.error is not None:
                    raise col.error
                if col.terminal is not None:
                    out = _with_tokens(col.terminal, col.tokens)
                    yield out if lp is None else lp.annotate(out)
                    return
                if col.tokens:
                    tokens, col.tokens = col.tokens, []
                    n_out += len(tokens)
                    out = LLMEngineOutput(token_ids=tokens)
                    yield out if lp is None else lp.annotate(out)
                    continue
                col.waiter = loop.create_future()
                await col.waiter
                col.waiter = None
        finally:
            remove_monitor()
            rank.collectors.pop(key, None)
            keys = self._ctx_keys.get(ctx.id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._ctx_keys[ctx.id]
            if not col.done:  # still queued or running: free it (on any exit path)
                rank.inbox.append((None, key))
                rank.wake.set()

    async def abort(self, ctx: Context) -> None:
        """Free the context's requests now; their streams end with a ``cancelled`` terminal."""
        for key in list(self._ctx_keys.get(ctx.id, ())):
            for rank in self._ranks:
                col = rank.collectors.get(key)
                if col is not None and not col.done:
                    col.cancelled = True
                    rank.inbox.append((None, key))
                    rank.wake.set()
                    col.wake()

    def _pick_rank(self, request: PreprocessedRequest) -> _Rank:
        hint = request.routing.dp_rank if request.routing is not None else None
        if hint is None:
            return min(self._ranks, key=lambda r: len(r.collectors))
        if not 0 <= hint < len(self._ranks):
            raise InvalidArgument(f"dp_rank {hint} out of range [0, {len(self._ranks)})")
        return self._ranks[hint]

    # -- the step loop -------------------------------------------------------------------------
    async def _step_loop(self, rank: _Rank) -> None:
        """One pass after another. While the rank stays busy each pass starts at the previous
        pass's end (an absolute deadline), not at whenever the loop got round to it: the loop's
        own cost (step(), delivery, sleep overshoot) then never adds to the modelled time."""
        sched = rank.scheduler
        previous_end: float | None = None  # end of the last pass while busy (None: idle)
        # On a real clock a pass's tokens leave before the loop publishes KV events and load and
        # plans the next pass, and overdue passes coalesce (see below). Not on a virtual clock:
        # nothing leaves sooner there, and a yield would let another rank's wake-up fire before
        # this rank registered its next pass.
        real_clock = isinstance(self.clock, RealClock)
        try:
            # routers learn the capacity before any request
            await self._publish_load(rank, settled=True)
            while True:
                latest_arrival = self._drain_inbox(rank)
                if not sched.has_work:
                    previous_end = None
                    # where the rank settled (an abort may also have freed blocks)
                    await self._publish_load(rank, settled=True)
                    rank.wake.clear()
                    await rank.wake.wait()
                    continue
                start = pass_start(self.clock.now(), previous_end, latest_arrival)
                out = sched.step(start)
                if out.is_empty:  # every running request awaits its KV transfer
                    previous_end = None
                    await self._publish_load(rank, settled=True)
                    await self._idle_until(rank, sched.next_ready_at())
                    continue
                if out.num_prefill_tokens and log.isEnabledFor(logging.DEBUG):
                    pass_log.prefill_pass(out, self.clock.now())
                hand_out = False  # let consumers take the tokens right after this pass
                if out.duration > 0:  # the pass ends at start + duration, whatever step() cost
                    previous_end = out.start + out.duration
                    delay = pass_sleep(self.clock.now(), previous_end, out.duration)
                    if delay > 0 or not real_clock:
                        await self.clock.sleep(delay)
                        hand_out = real_clock
                    else:
                        # Overdue already: the loop is behind the model's schedule (a high
                        # speedup on a busy host), so it runs as fast as it can, as at speedup
                        # 0, and hands tokens out likewise: after a prefill (first tokens at
                        # once) and every SPEEDUP0_SLICE_S of work. The overdue tokens of the
                        # passes in between leave together (one frame per request, not one
                        # frame and one consumer wake-up per token).
                        hand_out = (
                            out.num_prefill_tokens > 0 or time.perf_counter() >= rank.next_yield
                        )
                else:
                    previous_end = None
                    if out.num_prefill_tokens or time.perf_counter() >= rank.next_yield:
                        # Speedup 0 (no simulated time): let consumers and arrivals run after a
                        # prefill (first tokens go out at once) and every SPEEDUP0_SLICE_S of
                        # work; decode tokens in between reach the collectors (coalescing).
                        await asyncio.sleep(0)
                        rank.next_yield = time.perf_counter() + SPEEDUP0_SLICE_S
                self._deliver(rank, out)
                if hand_out:
                    await _let_tokens_leave()
                    rank.next_yield = time.perf_counter() + SPEEDUP0_SLICE_S
                await self._publish(rank, out)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("mocker step loop of rank %d crashed", rank.index)
            self._closed = True
            self._fail_all(EngineShutdown("the mocker's step loop crashed"))

    def _drain_inbox(self, rank: _Rank) -> float | None:
        """Apply queued arrivals and aborts; returns the latest arrival time (None: none)."""
        inbox, rank.inbox = rank.inbox, []
        latest: float | None = None
        for seq, key in inbox:
            if seq is not None:
                rank.scheduler.enqueue(seq)
                latest = seq.arrival if latest is None else max(latest, seq.arrival)
            elif rank.scheduler.abort(key):
                col = rank.collectors.get(key)
                if col is not None:
                    col.done = True
        return latest

    async def _idle_until(self, rank: _Rank, ready_at: float | None) -> None:
        """Wait for new inbox items or, at the latest, until ``ready_at``."""
        rank.wake.clear()
        if rank.inbox:
            return
        waiters: list[asyncio.Task[object]] = [
            asyncio.create_task(rank.wake.wait(), name=f"mocker-idle-wake:{rank.index}")
        ]
        if ready_at is not None:
            delay = max(0.0, ready_at - self.clock.now())
            waiters.append(
                asyncio.create_task(self.clock.sleep(delay), name=f"mocker-idle:{rank.index}")
            )
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    def _deliver(self, rank: _Rank, out: StepOutput) -> None:
        collectors = rank.collectors
        trace_first = log.isEnabledFor(logging.DEBUG)
        # Per token of the batch (~64 a pass at c=64): no calls beyond the needed ones (the
        # property ``num_output_tokens`` and ``_Collector.wake`` inlined).
        for seq, token in out.tokens:
            if len(seq.output) == 1:  # first token: count its cache hit
                rank.hit_rate.observe(seq.num_prompt_tokens, seq.num_cached_tokens or 0)
                if trace_first:
                    pass_log.first_token(seq, out, self.clock.now())
                if seq.handoff is not None:  # a received prompt: the modelled transfer
                    isl = seq.num_prompt_tokens
                    rank.disagg.handoffs += 1
                    rank.disagg.transfer_bytes += isl * (self.config.kv_bytes_per_token or 0)
                    rank.disagg.transfer_seconds += rank.scheduler.transfer_seconds(isl)
            col = collectors.get(seq.request_id)
            if col is not None:
                col.tokens.append(token)
                waiter = col.waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
        for seq in out.finished:
            col = collectors.get(seq.request_id)
            if col is not None:
                col.done = True
                col.terminal = self._finish_chunk(rank, seq)
                col.wake()

    def _finish_chunk(self, rank: _Rank, seq: Sequence) -> LLMEngineOutput:
        reason = seq.finish_reason or FinishReason.STOP
        out = _terminal(reason, [], seq, seq.num_output_tokens)
        if self.config.disaggregation_mode == "prefill":
            rank.disagg.handoffs += 1
            n_full = seq.num_prompt_tokens // self.config.block_size
            out.disaggregated_params = DisaggregatedParams(
                prefill_worker_id=self.worker_id or 0,
                prefill_dp_rank=rank.index,
                block_hashes=seq.block_hashes[:n_full],
                num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens or 0,
            )
        return out

    async def _publish(self, rank: _Rank, out: StepOutput) -> None:
        if out.events and self.kv_event_sink is not None:
            assert isinstance(out.events, list), "the live mocker publishes the event structs"
            batch = KVEventBatch(worker_id=self.worker_id or 0, events=out.events)
            try:
                await self.kv_event_sink(batch)
            except Exception:
                log.exception("KV event sink failed (rank %d)", rank.index)
        await self._publish_load(rank)

    async def _publish_load(self, rank: _Rank, *, settled: bool = False) -> None:
        if rank.load is not None:
            await rank.load.publish(settled=settled)

    def _fail_all(self, error: DynamoError) -> None:
        for rank in self._ranks:
            for col in rank.collectors.values():
                if col.terminal is None and col.error is None:
                    col.error = error
                    col.wake()

    # -- introspection -------------------------------------------------------------------------
    def health_check_payload(self) -> PreprocessedRequest:
        """One prompt token, one output token: the cheapest request that runs a full pass."""
        cfg = self.config
        return PreprocessedRequest(
            model=cfg.served_model_name,
            token_ids=[1],
            stop=StopConditions(max_tokens=1, ignore_eos=True),
            sampling=SamplingOptions(greedy=True),
        )

    def metrics_snapshot(self) -> list[RankMetrics]:
        """KV usage, running and waiting requests and prefix hit rate of every rank, now."""
        out = []
        for rank in self._ranks:
            sched = rank.scheduler
            out.append(
                RankMetrics(
                    dp_rank=rank.index,
                    kv_total_blocks=sched.kv.num_blocks,
                    kv_used_blocks=sched.kv.num_active_blocks,
                    num_running=sched.num_running,
                    # arrivals the loop has not drained yet wait too
                    num_waiting=sched.num_waiting + sum(seq is not None for seq, _ in rank.inbox),
                    prefix_cache_hit_rate=(
                        rank.hit_rate.rate if self.config.enable_prefix_caching else None
                    ),
                    disagg=(
                        None
                        if self.config.disaggregation_mode == "agg"
                        else dataclasses.replace(rank.disagg)  # a copy: the loop keeps counting
                    ),
                )
            )
        return out

    @property
    def schedulers(self) -> list[MockerScheduler]:
        return [rank.scheduler for rank in self._ranks]

    def check_invariants(self) -> None:
        for rank in self._ranks:
            rank.scheduler.check_invariants()


async def _let_tokens_leave() -> None:
    """Two turns of the event loop: in the first the woken consumers encode their outputs and
    queue them on their connections, in the second the connections write them (a request-plane
    connection flushes what one loop iteration queued at the end of it, ``tcp_connection.py``)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def _terminal(
    reason: FinishReason, tokens: list[int], seq: Sequence, completion_tokens: int
) -> LLMEngineOutput:
    usage = Usage(
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=seq.num_cached_tokens,
    )
    return LLMEngineOutput(token_ids=tokens, finish_reason=reason, usage=usage)


def _with_tokens(out: LLMEngineOutput, tokens: list[int]) -> LLMEngineOutput:
    if tokens:
        out.token_ids = tokens + out.token_ids
    return out

"""MockerEngine: the LLMEngine contract, cancellation, coalescing, DP ranks, sinks, disagg."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from mocker_sim import BlockSetSubscriber, make_request

from dynamo.backend.testing import check_engine
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.engine import MockerEngine
from dynamo.mocker.load_publisher import LOAD_INTERVAL_S
from dynamo.mocker.timing import VirtualClock, decode_ms, prefill_ms
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.kv_events import KVEventBatch
from dynamo.protocol.load import WorkerLoad
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, RoutingHints
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.runtime.context import Context
from dynamo.runtime.errors import EngineShutdown, InvalidArgument


def fast(**overrides: object) -> MockerConfig:
    return MockerConfig(speedup_ratio=0.0, **overrides)  # type: ignore[arg-type]


async def started(config: MockerConfig, **kwargs: object) -> MockerEngine:
    engine = MockerEngine(config, **kwargs)  # type: ignore[arg-type]
    await engine.start(0xABC)
    return engine


async def collect(stream: AsyncIterator[LLMEngineOutput]) -> list[LLMEngineOutput]:
    return [out async for out in stream]


async def settle(engine: MockerEngine, timeout: float = 2.0) -> None:
    """Wait until the step loops have applied every abort and no request is left (a loop may be
    sleeping through a pass when a stream ends)."""
    async with asyncio.timeout(timeout):
        while any(s.has_work for s in engine.schedulers):
            await asyncio.sleep(0.001)


def assert_idle(engine: MockerEngine) -> None:
    engine.check_invariants()
    for s in engine.schedulers:
        assert not s.has_work and s.kv.num_active_blocks == 0


@pytest.mark.parametrize("speedup", [0.0, 1.0])
async def test_conformance_kit(speedup: float) -> None:
    config = MockerConfig(speedup_ratio=speedup)  # the defaults: a 32,768-token context
    report = await check_engine(lambda: MockerEngine(config))
    assert report.ok, report.failures


async def test_generate_streams_tokens_then_one_terminal_with_usage() -> None:
    engine = await started(fast())
    try:
        chunks = await collect(engine.generate(make_request(100, 10), Context()))
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        last = chunks[-1]
        assert last.finish_reason is FinishReason.LENGTH and last.token_ids
        assert sum(len(c.token_ids) for c in chunks) == 10
        assert last.usage is not None
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (100, 10)
        again = await collect(engine.generate(make_request(100, 2), Context()))
        assert again[-1].usage is not None and again[-1].usage.cached_tokens == 64
        assert_idle(engine)
    finally:
        await engine.cleanup()


async def test_same_seed_same_tokens() -> None:
    engine = await started(fast())
    try:
        a = await collect(engine.generate(make_request(10, 20), Context("req-1")))
        b = await collect(engine.generate(make_request(10, 20), Context("req-1")))
        assert [t for c in a for t in c.token_ids] == [t for c in b for t in c.token_ids]
    finally:
        await engine.cleanup()


async def test_virtual_clock_timing_through_the_engine() -> None:
    clock = VirtualClock()
    engine = await started(MockerConfig(), clock=clock)
    try:
        times: list[float] = []
        async for out in engine.generate(make_request(1024, 4), Context()):
            times.extend([clock.now()] * len(out.token_ids))
        total = 16384 * 64
        assert times[0] * 1000 == pytest.approx(prefill_ms(1024), rel=1e-3)
        itl = [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False)]
        assert itl == [pytest.approx(decode_ms(c, total), rel=1e-3) for c in (1025, 1026, 1027)]
    finally:
        await engine.cleanup()


async def test_cancellation_ends_with_cancelled_and_frees_blocks() -> None:
    engine = await started(fast(block_size=16))
    try:
        ctx = Context()
        stream = engine.generate(make_request(200, 5000), ctx)
        first = await anext(stream)
        assert first.token_ids and engine.schedulers[0].kv.num_active_blocks > 0
        ctx.stop_generating()
        rest = await collect(stream)
        assert rest[-1].finish_reason is FinishReason.CANCELLED
        await settle(engine)
        assert_idle(engine)
    finally:
        await engine.cleanup()


async def test_consumer_that_walks_away_frees_its_request() -> None:
    engine = await started(fast())
    try:
        stream = engine.generate(make_request(300, 5000), Context())
        await anext(stream)
        await stream.aclose()  # no terminal read: the finally inside generate must free it
        await settle(engine)
        assert_idle(engine)
    finally:
        await engine.cleanup()


async def test_abort_frees_a_queued_request() -> None:
    engine = await started(MockerConfig(max_num_seqs=1))  # real time: the first one is slow
    try:
        first = asyncio.create_task(collect(engine.generate(make_request(50, 200), Context())))
        ctx = Context()
        stream = engine.generate(make_request(50, 10, start=500), ctx)
        pending = asyncio.create_task(collect(stream))
        await asyncio.sleep(0.05)
        assert engine.schedulers[0].num_waiting == 1
        await engine.abort(ctx)
        chunks = await asyncio.wait_for(pending, 2)
        assert chunks[-1].finish_reason is FinishReason.CANCELLED and not chunks[-1].token_ids
        async with asyncio.timeout(2):
            while engine.schedulers[0].num_waiting:
                await asyncio.sleep(0.001)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await settle(engine)
        assert_idle(engine)
    finally:
        await engine.cleanup()


async def test_slow_consumer_gets_coalesced_tokens() -> None:
    engine = await started(fast())
    try:
        sizes: list[int] = []
        async for out in engine.generate(make_request(20, 300), Context()):
            sizes.append(len(out.token_ids))
            await asyncio.sleep(0.01)  # a consumer slower than the engine
        assert sum(sizes) == 300
        assert max(sizes) > 1 and len(sizes) < 300
    finally:
        await engine.cleanup()


async def test_impossible_requests_are_rejected_with_invalid_argument() -> None:
    engine = await started(fast(data_parallel_size=2, context_length=1000))
    try:
        with pytest.raises(InvalidArgument):
            await collect(engine.generate(make_request(990, 50), Context()))
        bad_rank = make_request(10, 5)
        bad_rank.routing = RoutingHints(dp_rank=2)
        with pytest.raises(InvalidArgument):
            await collect(engine.generate(bad_rank, Context()))
        assert_idle(engine)
    finally:
        await engine.cleanup()


async def test_dp_rank_hint_and_sinks() -> None:
    batches: list[KVEventBatch] = []
    loads: list[WorkerLoad] = []

    async def kv_sink(batch: KVEventBatch) -> None:
        batches.append(batch)

    async def load_sink(load: WorkerLoad) -> None:
        loads.append(load)

    engine = await started(
        fast(data_parallel_size=2, block_size=16), kv_event_sink=kv_sink, load_sink=load_sink
    )
    try:
        await asyncio.sleep(LOAD_INTERVAL_S)  # past the announcement's interval: loads go out
        requests: list[PreprocessedRequest] = []
        for i in range(6):
            req = make_request(40 + i, 20, start=1 + 50 * (i % 3))
            req.routing = RoutingHints(dp_rank=1)
            requests.append(req)
        await asyncio.gather(*(collect(engine.generate(r, Context())) for r in requests))
        async with asyncio.timeout(2):  # the idle load follows within the interval
            while loads[-1].num_running:
                await asyncio.sleep(0.005)
        assert not engine.schedulers[0].kv.cached_blocks()
        assert batches and all(b.worker_id == 0xABC for b in batches)
        sub = BlockSetSubscriber()
        for b in batches:
            assert all(e.dp_rank == 1 for e in b.events)
            sub.apply(b.events)
        assert sub.blocks == engine.schedulers[1].kv.cached_blocks()
        assert [ld.dp_rank for ld in loads[:2]] == [0, 1]  # each rank announces itself
        assert loads[0].total_blocks == 16384 and loads[0].num_running == 0
        assert {ld.dp_rank for ld in loads[2:]} == {1} and loads[-1].active_decode_blocks == 0
        assert any(ld.num_running > 0 for ld in loads)
    finally:
        await engine.cleanup()


async def test_load_goes_out_at_most_every_interval_and_settles_when_idle() -> None:
    """Busy, a rank's load (here changing every pass: one block per token) goes out at most
    every LOAD_INTERVAL_S of the engine's clock; the load it settles at goes out at once."""
    clock = VirtualClock()
    sent: list[tuple[float, WorkerLoad]] = []

    async def load_sink(load: WorkerLoad) -> None:
        sent.append((clock.now(), load))

    engine = await started(MockerConfig(block_size=1), clock=clock, load_sink=load_sink)
    try:
        outs = await collect(engine.generate(make_request(1024, 40), Context()))
        assert sum(len(o.token_ids) for o in outs) == 40
        await settle(engine)
        await asyncio.sleep(0)  # the loop publishes before it waits
        times = [t for t, _ in sent]
        busy = [ld for _, ld in sent if ld.num_running]
        assert 3 <= len(busy) < 40 * decode_ms(1064, 16384 * 64) / 1000 / LOAD_INTERVAL_S + 2
        # every message of the busy rank follows the previous one by the interval at least
        gaps = [b - a for a, b in zip(times[1:-1], times[2:-1], strict=False)]
        assert all(g >= LOAD_INTERVAL_S for g in gaps), gaps
        assert len({ld.active_decode_blocks for ld in busy}) == len(busy)  # each one a change
        last = sent[-1][1]
        assert last.num_running == 0 and last.active_decode_blocks == 0
    finally:
        await engine.cleanup()


async def test_timed_pass_hands_out_tokens_before_publishing() -> None:
    """On a real clock a pass's tokens reach their consumers before the step loop publishes
    the pass's KV events (and plans the next pass): the first token is not held behind them."""
    order: list[str] = []

    async def kv_sink(batch: KVEventBatch) -> None:
        order.append("kv")

    engine = await started(MockerConfig(speedup_ratio=1000.0, block_size=16), kv_event_sink=kv_sink)
    try:
        async for out in engine.generate(make_request(40, 3), Context()):
            if out.token_ids and "token" not in order:
                order.append("token")
        assert "kv" in order  # the prefill pass stored two blocks
        assert order.index("token") < order.index("kv"), order
    finally:
        await engine.cleanup()


async def test_overdue_passes_hand_out_their_tokens_together() -> None:
    """A loop behind the model's schedule (here every pass is overdue: a 10^6 speedup) runs
    like speedup 0: the first token leaves alone at once, later ones together, not one
    output per pass."""
    engine = await started(MockerConfig(speedup_ratio=1e6))
    try:
        sizes = [
            len(out.token_ids)
            async for out in engine.generate(make_request(40, 300, ignore_eos=True), Context())
        ]
        assert sum(sizes) == 300
        assert sizes[0] == 1
        assert len(sizes) < 150, sizes  # coalesced (one output per pass would be 300)
    finally:
        await engine.cleanup()


async def test_prefill_worker_returns_one_token_and_a_handoff() -> None:
    engine = await started(fast(disaggregation_mode="prefill", data_parallel_size=2))
    try:
        req = make_request(200, 100)
        req.routing = RoutingHints(dp_rank=1)
        [only] = await collect(engine.generate(req, Context()))
        assert len(only.token_ids) == 1 and only.finish_reason is FinishReason.LENGTH
        params = only.disaggregated_params
        assert params is not None
        assert (params.prefill_worker_id, params.prefill_dp_rank) == (0xABC, 1)
        assert params.num_prompt_tokens == 200 and len(params.block_hashes) == 3
        assert params.block_hashes == sequence_hashes(local_block_hashes(req.token_ids, 64))
    finally:
        await engine.cleanup()


async def test_decode_worker_pays_the_transfer_then_decodes() -> None:
    clock = VirtualClock()
    config = MockerConfig(disaggregation_mode="decode", kv_bytes_per_token=131072)
    engine = await started(config, clock=clock)
    try:
        handoff = DisaggregatedParams(prefill_worker_id=1, num_prompt_tokens=1024)
        req = make_request(1024, 3, prefill_result=handoff)
        first = await anext(engine.generate(req, Context()).__aiter__())
        transfer_ms = 1024 * 131072 / 64e9 * 1000
        expected = transfer_ms + decode_ms(1024, 16384 * 64)
        assert first.token_ids and clock.now() * 1000 == pytest.approx(expected, rel=1e-3)
    finally:
        await engine.cleanup()


async def test_lifecycle_cleanup_is_idempotent_and_ends_open_streams() -> None:
    await MockerEngine(fast()).cleanup()  # never started
    engine = await started(MockerConfig())
    stream = engine.generate(make_request(10, 10_000), Context())
    await anext(stream)
    await engine.cleanup()
    await engine.cleanup()
    with pytest.raises(EngineShutdown):
        await collect(stream)
    with pytest.raises(EngineShutdown):
        await collect(engine.generate(make_request(10, 5), Context()))


async def test_drain_fails_in_flight_work() -> None:
    engine = await started(MockerConfig())
    try:
        stream = engine.generate(make_request(10, 10_000), Context())
        await anext(stream)
        await engine.drain()
        with pytest.raises(EngineShutdown):
            await collect(stream)
        await settle(engine)
        assert_idle(engine)
    finally:
        await engine.cleanup()


async def test_without_a_hint_requests_spread_over_ranks() -> None:
    engine = await started(fast(data_parallel_size=2))
    try:
        streams = [
            engine.generate(make_request(30, 5000, start=100 * i), Context()) for i in range(4)
        ]
        firsts = [await anext(s) for s in streams]
        assert all(f.token_ids for f in firsts)
        assert [s.num_running + s.num_waiting for s in engine.schedulers] == [2, 2]
        for s in streams:
            await s.aclose()
        await settle(engine)
        assert_idle(engine)
    finally:
        await engine.cleanup()


async def test_debug_log_splits_each_time_to_first_token(caplog: pytest.LogCaptureFixture) -> None:
    # benchmarks/faults.py reads this line to split a migration's gap into its parts.
    clock = VirtualClock()
    engine = await started(MockerConfig(), clock=clock)
    try:
        with caplog.at_level(logging.DEBUG, logger="dynamo.mocker.engine"):
            await collect(engine.generate(make_request(1024, 2), Context("split-1")))
        lines = [r.getMessage() for r in caplog.records if "first token of" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("first token of split-1#")
        fields = dict(kv.split("=") for kv in lines[0].split()[4:])
        assert float(fields["queued_ms"]) == pytest.approx(0.0, abs=1e-6)
        assert float(fields["pass_ms"]) == pytest.approx(prefill_ms(1024), rel=1e-3)
        assert float(fields["late_ms"]) == pytest.approx(0.0, abs=1e-3)
        assert fields["pass_prefill_tokens"] == fields["prompt_tokens"] == "1024"
        assert (fields["cached_tokens"], fields["decodes"]) == ("0", "0")
        # And when that pass started, at once (a killed worker's pass in progress: when its
        # streams' next token was due); the decode pass after it is not logged.
        starts = [r.getMessage() for r in caplog.records if "prefill pass:" in r.getMessage()]
        assert len(starts) == 1
        fields = dict(kv.split("=") for kv in starts[0].split()[2:])
        assert float(fields["pass_ms"]) == pytest.approx(prefill_ms(1024), rel=1e-3)
        assert float(fields["ends_in_ms"]) == pytest.approx(prefill_ms(1024), rel=1e-3)
        assert (fields["pass_prefill_tokens"], fields["decodes"]) == ("1024", "0")
    finally:
        await engine.cleanup()

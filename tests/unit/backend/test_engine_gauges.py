"""Engine gauges on the worker's metrics registry (what its status server's /metrics serves,
``test_status_server.py``): KV usage, running and waiting requests, prefix hit rate, read from
any engine's ``metrics_snapshot()`` at every scrape (the mocker fills them). No sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.backend.engine import RankMetrics
from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.engine import MockerEngine
from dynamo.observability.engine_metrics import EngineGauges, HitRateWindow
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.context import Context
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub
from tests.fakes import CountingEngine

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")


def samples(text: str, name: str) -> dict[tuple[str, str], float]:
    """``name``'s samples by (worker_id, dp_rank)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[(s.labels["worker_id"], s.labels["dp_rank"])] = s.value
    return out


def test_hit_rate_window() -> None:
    w = HitRateWindow(size=2)
    assert w.rate is None  # no measurement is not 0 %
    w.observe(100, 0)
    assert w.rate == 0.0
    w.observe(100, 50)
    assert w.rate == pytest.approx(0.25)
    w.observe(100, 100)  # the first request leaves the window
    assert w.rate == pytest.approx(0.75)
    w2 = HitRateWindow()
    w2.observe(0, 0)
    assert w2.rate == 0.0


def test_collector_renders_every_rank_with_reference_names() -> None:
    registry = CollectorRegistry(auto_describe=True)
    snaps: list[tuple[str, int, Sequence[RankMetrics]]] = [
        ("m", 7, [RankMetrics(0, 100, 25, 3, 2, 0.5), RankMetrics(1, 100, 0, 0, 0, None)])
    ]
    EngineGauges(registry, "ns", "backend", "generate", lambda: snaps)
    text = generate_latest(registry).decode()
    assert samples(text, "dynamo_component_total_blocks") == {("7", "0"): 100, ("7", "1"): 100}
    usage = samples(text, "dynamo_component_gpu_cache_usage_percent")
    assert usage == {("7", "0"): 0.25, ("7", "1"): 0.0}
    assert samples(text, "dynamo_component_kv_cache_hit_rate") == {("7", "0"): 0.5}  # None: out
    assert samples(text, "dynamo_component_num_requests_running")[("7", "0")] == 3
    assert samples(text, "dynamo_component_num_requests_waiting")[("7", "0")] == 2
    assert 'dynamo_namespace="ns"' in text and 'model="m"' in text
    snaps.clear()  # collected at every scrape: an engine that went away leaves no stale series
    assert "dynamo_component_total_blocks{" not in generate_latest(registry).decode()


def request(tokens: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="demo", token_ids=tokens, stop=StopConditions(max_tokens=max_tokens, ignore_eos=True)
    )


def scrape_text(worker: Worker) -> str:
    """What a scrape of the worker's /metrics reads."""
    return generate_latest(worker.metrics_registry).decode()


@pytest.fixture
async def mocker_worker() -> AsyncIterator[tuple[Worker, MockerEngine]]:
    engine = MockerEngine(
        MockerConfig(model_name="demo", num_gpu_blocks=1024, block_size=16, max_num_seqs=1)
    )
    config = WorkerConfig(runtime=RUNTIME, install_signal_handlers=False)
    worker = Worker(
        [engine], config, runtime=DistributedRuntime(RUNTIME, InProcessHub()), owns_runtime=True
    )
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.ready.wait(), 10)
        yield worker, engine
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(task, 15)


async def test_mocker_gauges_on_the_worker_metrics(
    mocker_worker: tuple[Worker, MockerEngine],
) -> None:
    worker, engine = mocker_worker
    key = (str(worker.worker_ids[0]), "0")

    async def scrape(name: str) -> float | None:
        return samples(scrape_text(worker), name).get(key)

    assert await scrape("dynamo_component_total_blocks") == 1024
    assert await scrape("dynamo_component_gpu_cache_usage_percent") == 0.0
    assert await scrape("dynamo_component_kv_cache_hit_rate") is None  # nothing measured

    # max_num_seqs=1: one long request runs, the second waits.
    prompt = list(range(1, 161))  # 10 blocks of 16
    ctxs = [Context(), Context()]

    async def consume(ctx: Context) -> None:
        async for _ in engine.generate(request(prompt, 2000), ctx):
            pass

    tasks = [asyncio.create_task(consume(ctx)) for ctx in ctxs]
    async with asyncio.timeout(5):
        while await scrape("dynamo_component_num_requests_running") != 1:
            await asyncio.sleep(0.01)
    assert await scrape("dynamo_component_num_requests_waiting") == 1
    usage = await scrape("dynamo_component_gpu_cache_usage_percent")
    assert usage is not None and usage >= 10 / 1024  # the running prompt's 10 blocks
    async with asyncio.timeout(5):  # measured once the first prefill is done: a cold cache
        while await scrape("dynamo_component_kv_cache_hit_rate") is None:
            await asyncio.sleep(0.01)
    assert await scrape("dynamo_component_kv_cache_hit_rate") == 0.0
    for ctx in ctxs:
        ctx.stop_generating()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    async with asyncio.timeout(5):
        while await scrape("dynamo_component_num_requests_running"):
            await asyncio.sleep(0.01)
    assert await scrape("dynamo_component_num_requests_waiting") == 0

    # The same prompt again: its 10 full blocks come from the prefix cache.
    outs = [out async for out in engine.generate(request(prompt, 2), Context())]
    usage_out = outs[-1].usage
    assert usage_out is not None and usage_out.cached_tokens
    assert usage_out.cached_tokens >= 159  # the last prompt token is always computed
    rate = await scrape("dynamo_component_kv_cache_hit_rate")
    assert rate == pytest.approx((0 + usage_out.cached_tokens) / (160 + 160))


class SnapshotEngine(CountingEngine):
    """Any engine fills the same gauges through the contract."""

    def metrics_snapshot(self) -> list[RankMetrics]:
        return [RankMetrics(dp_rank=0, kv_total_blocks=10, kv_used_blocks=4, num_running=1,
                            num_waiting=0, prefix_cache_hit_rate=0.9)]  # fmt: skip


class BrokenSnapshot(CountingEngine):
    def metrics_snapshot(self) -> list[RankMetrics]:
        raise RuntimeError("stats unavailable")


async def test_gauges_are_engine_generic_and_survive_a_failing_engine() -> None:
    config = WorkerConfig(runtime=RUNTIME, install_signal_handlers=False)
    worker = Worker(
        [SnapshotEngine(), BrokenSnapshot()],
        config,
        runtime=DistributedRuntime(RUNTIME, InProcessHub()),
        owns_runtime=True,
    )
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.ready.wait(), 10)
        text = scrape_text(worker)  # the failing engine's gauges are left out, not the others'
        usage = samples(text, "dynamo_component_gpu_cache_usage_percent")
        assert usage == {(str(worker.worker_ids[0]), "0"): 0.4}
        assert 'model="test-model"' in text
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(task, 15)

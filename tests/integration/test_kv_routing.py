"""KV-aware routing through the whole stack in one process (issue 5)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from dynamo.frontend.pipeline import ModelPipeline
from dynamo.preprocess import GenerationParams
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.router.config import KVRouterSettings
from dynamo.router.hashing import local_block_hashes
from dynamo.router.kv_router import KVRouter
from dynamo.runtime.runtime import InProcessHub
from tests.integration.conftest import RUNTIME, Stack

pytestmark = pytest.mark.integration

MOCKER = ("--speedup-ratio", "0", "--block-size", "16", "--num-gpu-blocks-override", "512")


def prompt(group: int, unique: int) -> str:
    words = " ".join(f"topic{group} sentence {i} about group {group}." for i in range(60))
    return f"{words} Question {unique}: what next?"


async def chat(stack: Stack, text: str) -> dict:
    assert stack.client is not None
    r = await stack.client.post(
        "/v1/chat/completions",
        json={
            "model": "demo",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
            "nvext": {"extra_fields": ["worker_id"]},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


async def wait_indexed(stack: Stack, text: str, worker_id: int, dp_rank: int = 0) -> None:
    """Until the KV router's index holds the prompt of ``text`` on that worker rank: the
    request's KV events reach the router through the event plane (another task), so its
    response can come first, however long a fixed sleep would wait on a loaded machine."""
    assert stack.frontend is not None
    entry = stack.frontend.registry.get("demo")
    router = entry.router
    assert isinstance(router, KVRouter) and router.indexer is not None
    assert entry.pipeline is not None
    prepared = entry.pipeline.preprocessor.chat(
        [{"role": "user", "content": text}], GenerationParams(max_tokens=4)
    )
    local = local_block_hashes(prepared.request.token_ids, 16)
    async with asyncio.timeout(10):
        while router.indexer.find_matches(local).get((worker_id, dp_rank), 0) < len(local) - 1:
            await asyncio.sleep(0.01)


async def test_shared_prefixes_go_to_the_worker_that_holds_them(stack: Stack) -> None:
    for _ in range(4):
        await stack.add_worker(*MOCKER)
    await stack.start_frontend(router_mode="kv")
    await stack.wait_for_model(instances=4)
    owner: dict[int, int] = {}
    for group in range(4):
        first = await chat(stack, prompt(group, 0))
        owner[group] = first["nvext"]["worker_id"]["decode_worker_id"]
        await wait_indexed(stack, prompt(group, 0), owner[group])
    for group in range(4):
        for unique in range(1, 4):
            body = await chat(stack, prompt(group, unique))
            assert body["nvext"]["worker_id"]["decode_worker_id"] == owner[group]
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            prompt_tokens = body["usage"]["prompt_tokens"]
            assert cached >= (prompt_tokens // 16 - 2) * 16, (cached, prompt_tokens)


async def test_router_started_late_recovers_its_view_from_workers(stack: Stack) -> None:
    for _ in range(2):
        await stack.add_worker(*MOCKER)
    await stack.start_frontend(router_mode="round-robin")
    await stack.wait_for_model(instances=2)
    for unique in range(4):
        await chat(stack, prompt(7, unique))  # round-robin: both workers cache group 7
    assert stack.frontend is not None
    entry = stack.frontend.registry.get("demo")
    cards = [entry.cards[i] for i in entry.live_instance_ids()]
    # A brand-new KV router on the same runtime: it must learn both workers' blocks.
    router = await KVRouter.create(stack.frontend.runtime, cards[0], KVRouterSettings())
    try:
        pipeline: ModelPipeline = entry.pipeline
        prepared = pipeline.preprocessor.chat(
            [{"role": "user", "content": prompt(7, 99)}],
            GenerationParams(max_tokens=2),
        )
        router.select(prepared.request, cards)  # meets the workers -> recovery dumps
        router.on_finish(prepared.request.request_id or "")
        assert router.indexer is not None
        async with asyncio.timeout(5):
            while True:
                local = local_block_hashes(prepared.request.token_ids, 16)
                matches = router.indexer.find_matches(local)
                if len(matches) == 2 and min(matches.values()) > 10:
                    break
                await asyncio.sleep(0.05)
        router.indexer.check_invariants()
    finally:
        await router.close()


@pytest.fixture(params=["local", "nats"])
async def planes_stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """The one-process stack on the local event plane, or on a real NATS server."""
    runtime = RUNTIME
    if request.param == "nats":
        url = request.getfixturevalue("nats_server").url
        runtime = dataclasses.replace(RUNTIME, event_plane="nats", nats_server=url)
    s = Stack(InProcessHub(), runtime=runtime)
    yield s
    await s.close()


async def test_replica_sync_shares_active_load(planes_stack: Stack) -> None:
    stack = planes_stack
    await stack.add_worker(*MOCKER)
    await stack.start_frontend(router_mode="round-robin")
    await stack.wait_for_model()
    assert stack.frontend is not None
    entry = stack.frontend.registry.get("demo")
    card = entry.cards[entry.live_instance_ids()[0]]
    settings = KVRouterSettings(replica_sync=True)
    a = await KVRouter.create(stack.frontend.runtime, card, settings)
    b = await KVRouter.create(stack.frontend.runtime, card, settings)
    try:
        request = PreprocessedRequest(
            model="demo",
            token_ids=list(range(64)),
            request_id="sync-1",
            stop=StopConditions(max_tokens=4),
        )
        b.select(  # b meets the worker (so it can apply a's events), then frees its own
            PreprocessedRequest(model="demo", token_ids=[1], request_id="b-own"), [card]
        )
        b.on_finish("b-own")
        a.select(request, [card])
        async with asyncio.timeout(5):
            while "sync-1" not in b.sequences:
                await asyncio.sleep(0.01)
        assert b.sequences.active_prefill_tokens(card.instance_id) == 64
        assert b.sequences.active_decode_blocks(card.instance_id) == 4
        a.on_first_token("sync-1")
        async with asyncio.timeout(5):
            while b.sequences.active_prefill_tokens(card.instance_id):
                await asyncio.sleep(0.01)
        a.on_finish("sync-1")
        async with asyncio.timeout(5):
            while "sync-1" in b.sequences:
                await asyncio.sleep(0.01)
        # own echoes are ignored: a's state is exactly its own
        assert "sync-1" not in a.sequences and "b-own" not in a.sequences
        b.sequences.check_invariants()
    finally:
        await a.close()
        await b.close()


async def test_all_workers_busy_is_overload(stack: Stack) -> None:
    await stack.add_worker(*MOCKER)
    client = await stack.start_frontend(
        router_mode="kv",
        kv=KVRouterSettings(active_prefill_tokens_threshold=0),
    )
    await stack.wait_for_model()
    # With threshold 0 a worker with any prefill in flight is busy.
    ok = await client.post(
        "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text
    assert stack.frontend is not None
    entry = stack.frontend.registry.get("demo")
    router = entry.router
    assert isinstance(router, KVRouter)
    worker_id = entry.live_instance_ids()[0]
    router.sequences.add_request("held", worker_id, 0, [1, 2], new_isl_tokens=32)
    r = await client.post(
        "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}
    )
    assert r.status_code == 529, r.text
    assert r.headers["retry-after"]
    assert r.json()["error"]["type"] == "overloaded"
    router.on_finish("held")
    ok = await client.post(
        "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text


async def test_approximate_mode_routes_by_its_own_decisions(stack: Stack) -> None:
    for _ in range(3):
        await stack.add_worker(*MOCKER)
    await stack.start_frontend(router_mode="kv", kv=KVRouterSettings(use_kv_events=False))
    await stack.wait_for_model(instances=3)
    owner = (await chat(stack, prompt(3, 0)))["nvext"]["worker_id"]["decode_worker_id"]
    for unique in range(1, 4):
        body = await chat(stack, prompt(3, unique))
        assert body["nvext"]["worker_id"]["decode_worker_id"] == owner
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert stack.frontend is not None
    router = stack.frontend.registry.get("demo").router
    assert isinstance(router, KVRouter) and router.indexer is None and router.approx is not None
    router.approx.check_invariants()


async def test_router_metrics_are_exposed(stack: Stack) -> None:
    await stack.add_worker(*MOCKER)
    client = await stack.start_frontend(router_mode="kv")
    await stack.wait_for_model()
    first = await chat(stack, prompt(1, 0))
    await wait_indexed(stack, prompt(1, 0), first["nvext"]["worker_id"]["decode_worker_id"])
    await chat(stack, prompt(1, 1))
    text = (await client.get("/metrics")).text
    assert stack.frontend is not None
    router_id = str(stack.frontend.router_metrics.router_id)
    for phase in ("block_hashing", "seq_hashing", "indexer_find_matches", "scheduling", "total"):
        name = f"dynamo_router_overhead_{phase}_ms"
        count = f'{name}_count{{router_id="{router_id}"}} 2.0'
        assert count in text, name  # one observation per routed request
    # the reference's buckets: hashing from 1 us doubling, the others from 10 us tripling
    assert 'dynamo_router_overhead_block_hashing_ms_bucket{le="0.001",' in text
    assert 'dynamo_router_overhead_total_ms_bucket{le="0.03",' in text
    assert "dynamo_router_kv_hit_rate_bucket" in text
    assert 'dynamo_component_kv_cache_events_applied_total{event_type="stored",status="ok"}' in text


async def test_dp_ranks_are_routing_targets(stack: Stack) -> None:
    await stack.add_worker(*MOCKER, "--data-parallel-size", "2")
    client = await stack.start_frontend(router_mode="kv")
    await stack.wait_for_model()
    for group, rank in ((5, 0), (6, 1)):  # seed each rank's cache through the dp_rank hint
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "demo",
                "messages": [{"role": "user", "content": prompt(group, 0)}],
                "max_tokens": 4,
                "nvext": {"dp_rank": rank, "extra_fields": ["worker_id"]},
            },
        )
        worker = r.json()["nvext"]["worker_id"]
        assert worker["decode_dp_rank"] == rank
        await wait_indexed(stack, prompt(group, 0), worker["decode_worker_id"], rank)
    for group, rank in ((5, 0), (6, 1)):  # no hint: the rank holding the prefix wins
        body = await chat(stack, prompt(group, 1))
        assert body["nvext"]["worker_id"]["decode_dp_rank"] == rank
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 100


async def test_a_worker_started_after_the_frontend_is_indexed_from_its_first_event(
    stack: Stack,
) -> None:
    import msgspec

    from dynamo.runtime.context import Context
    from dynamo.runtime.naming import EndpointId

    await stack.add_worker(*MOCKER)
    await stack.start_frontend(router_mode="kv")
    await stack.wait_for_model()
    late = await stack.add_worker(*MOCKER)
    await stack.wait_for_model(instances=2)
    assert stack.frontend is not None
    (late_id,) = late.worker_ids
    entry = stack.frontend.registry.get("demo")
    router = entry.router
    assert isinstance(router, KVRouter) and router.indexer is not None
    assert router.sequences.has_rank(late_id, 0), "known from discovery, before any request"
    # A request that reaches the late worker without the router: its KV events alone must
    # put its blocks in the router's index.
    assert entry.pipeline is not None
    prepared = entry.pipeline.preprocessor.chat(
        [{"role": "user", "content": prompt(11, 0)}], GenerationParams(max_tokens=2)
    )
    client = await stack.frontend.runtime.client(EndpointId("dynamo", "backend", "generate"))
    body = msgspec.msgpack.encode(prepared.request)
    async for _ in client.stream(body, Context(), instance_id=late_id):
        pass
    local = local_block_hashes(prepared.request.token_ids, 16)
    async with asyncio.timeout(5):
        while router.indexer.find_matches(local).get((late_id, 0), 0) < len(local) - 1:
            await asyncio.sleep(0.02)

"""The KV router's cache-consistency check through the whole stack in one process: events the
router drops on purpose show as drift (metric and /health detail), and the resync clears it."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.protocol.kv_events import BlocksRemoved, BlocksStored, KVCacheEvent
from dynamo.protocol.model_card import WorkerRole
from dynamo.router.config import KVRouterSettings
from dynamo.router.indexer import EventStatus
from dynamo.router.kv_router import KVRouter
from tests.integration.conftest import Stack

pytestmark = pytest.mark.integration


async def ask(stack: Stack, text: str) -> None:
    assert stack.client is not None
    r = await stack.client.post(
        "/v1/completions", json={"model": "demo", "prompt": text, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text


async def settled(router: KVRouter, worker: int) -> int:
    """Check until the round covers the worker (no events in flight); its drift."""
    async with asyncio.timeout(10):
        while True:
            for state in await router.check_consistency():
                if state.worker_id == worker:
                    return state.drift_blocks
            await asyncio.sleep(0.05)


async def test_dropped_events_show_as_drift_and_the_resync_clears_it(stack: Stack) -> None:
    worker = await stack.add_worker("--speedup-ratio", "0", "--block-size", "16")
    wid = worker.worker_ids[0]
    kv = KVRouterSettings(consistency_check_interval_s=0)  # checked by hand here
    await stack.start_frontend(router_mode="kv", kv=kv)
    await stack.wait_for_model()
    assert stack.frontend is not None and stack.client is not None
    (entry,) = stack.frontend.registry.models()
    router = entry.routers[WorkerRole.AGGREGATED]
    assert isinstance(router, KVRouter) and router.indexer is not None
    reg = stack.frontend.metrics.registry
    labels = {"model": "demo", "worker_id": f"{wid:x}", "dp_rank": "0"}

    await ask(stack, "first prompt " * 40)
    assert await settled(router, wid) == 0
    assert reg.get_sample_value("dynamo_router_kv_index_drift_blocks", labels) == 0
    assert router.indexer.num_blocks(wid) > 0

    # Drop the router's stored events on purpose: their ids still arrive (no gap is seen),
    # their blocks do not.
    indexer = router.indexer
    original = indexer.apply
    dropped = 0

    def dropping(worker_id: int, event: KVCacheEvent) -> EventStatus:
        nonlocal dropped
        if isinstance(event.data, BlocksStored):
            dropped += len(event.data.blocks)
            event = KVCacheEvent(
                event_id=event.event_id, data=BlocksRemoved(block_hashes=[]), dp_rank=event.dp_rank
            )
        return original(worker_id, event)

    indexer.apply = dropping  # type: ignore[method-assign]
    await ask(stack, "second, different prompt " * 40)
    drift = await settled(router, wid)
    indexer.apply = original  # type: ignore[method-assign]
    assert dropped > 0 and drift == dropped
    assert reg.get_sample_value("dynamo_router_kv_index_drift_blocks", labels) == drift
    resyncs = {"model": "demo", "worker_id": f"{wid:x}"}
    assert reg.get_sample_value("dynamo_router_kv_index_resyncs_total", resyncs) == 1
    health = (await stack.client.get("/health")).json()
    (detail,) = health["kv_consistency"]
    assert detail["worker_id"] == f"{wid:x}" and detail["drift_blocks"] == drift
    assert detail["router_blocks"] + drift == detail["worker_blocks"]

    # The resync (a full re-read of the worker's local index) cleared it.
    assert await settled(router, wid) == 0
    assert reg.get_sample_value("dynamo_router_kv_index_drift_blocks", labels) == 0
    assert reg.get_sample_value("dynamo_router_kv_index_resyncs_total", resyncs) == 1
    health = (await stack.client.get("/health")).json()
    assert health["kv_consistency"][0]["drift_blocks"] == 0
    assert health["kv_consistency"][0]["resyncs"] == 1

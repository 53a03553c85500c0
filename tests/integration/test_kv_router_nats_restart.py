"""The KV router through a NATS restart (issue 15's fault): two mockers publish KV events on the
NATS event plane while requests flow, nats-server is restarted mid-run; every request succeeds
(the request plane does not go through NATS, so none needed to fail), events flow again after
the clients reconnect, and the router's index converges on what each worker holds (the
consistency check compares block counts and digests) without a forced full resync."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest

from dynamo.protocol.model_card import WorkerRole
from dynamo.router.config import KVRouterSettings
from dynamo.router.kv_router import KVRouter
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import InProcessHub
from tests.integration.conftest import Stack
from tests.servers import NatsServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def nats_stack(nats_server: NatsServer) -> AsyncIterator[Stack]:
    runtime = RuntimeConfig(
        discovery_backend="memory",
        request_plane="local",
        event_plane="nats",
        nats_server=nats_server.url,
    )
    s = Stack(InProcessHub(), runtime=runtime)
    yield s
    await s.close()


async def ask(stack: Stack, text: str, worker: int) -> int:
    """One request pinned to ``worker``; its HTTP status."""
    assert stack.client is not None
    body = {
        "model": "demo",
        "prompt": text,
        "max_tokens": 2,
        "nvext": {"backend_instance_id": worker},
    }
    r = await stack.client.post("/v1/completions", json=body)
    return r.status_code


async def converged(router: KVRouter, workers: list[int], timeout: float = 30) -> None:
    """Until a consistency round finds every worker's index equal to the router's view."""
    async with asyncio.timeout(timeout):
        while True:
            states = {s.worker_id: s for s in await router.check_consistency()}
            if all(w in states and states[w].drift_blocks == 0 for w in workers):
                for w in workers:
                    assert states[w].router_blocks == states[w].worker_blocks > 0
                return
            await asyncio.sleep(0.2)


async def test_nats_restart_mid_run_index_converges_no_request_fails(
    nats_stack: Stack, nats_server: NatsServer
) -> None:
    stack = nats_stack
    workers = []
    for _ in range(2):
        worker = await stack.add_worker("--speedup-ratio", "0", "--block-size", "16")
        workers.append(worker.worker_ids[0])
    kv = KVRouterSettings(consistency_check_interval_s=0)  # checked by hand here
    await stack.start_frontend(router_mode="kv", kv=kv)
    await stack.wait_for_model(instances=2)
    assert stack.frontend is not None
    (entry,) = stack.frontend.registry.models()
    router = entry.routers[WorkerRole.AGGREGATED]
    assert isinstance(router, KVRouter) and router.indexer is not None

    for i, w in enumerate(workers):
        assert await ask(stack, f"warm prompt {i} " * 30, w) == 200
    await converged(router, workers)

    # Requests keep flowing (and KV events with them) while nats-server restarts.
    statuses: list[int] = []
    stop = asyncio.Event()
    counter = itertools.count()

    async def load(w: int) -> None:
        while not stop.is_set():
            statuses.append(await ask(stack, f"load {next(counter)} text " * 20, w))

    loaders = [asyncio.create_task(load(w), name=f"load-{w:x}") for w in workers]
    try:
        await asyncio.sleep(0.5)
        before = len(statuses)
        await asyncio.to_thread(nats_server.restart)
        await asyncio.sleep(1.0)
        assert len(statuses) > before  # served throughout
    finally:
        stop.set()
        await asyncio.gather(*loaders)
    assert statuses and set(statuses) == {200}, sorted(set(statuses))

    # Events flow again: a fresh prompt's blocks reach the router's index through NATS.
    indexer = router.indexer
    for i, w in enumerate(workers):
        blocks = indexer.num_blocks(w)
        async with asyncio.timeout(30):
            while indexer.num_blocks(w) <= blocks:
                assert await ask(stack, f"after restart {i} {next(counter)} " * 30, w) == 200
                await asyncio.sleep(0.2)
    await converged(router, workers)
    resyncs = [s.resyncs for s in router.consistency.values()]
    assert resyncs and all(r == 0 for r in resyncs)  # converged by events and recovery alone

"""A KV router started late, on the NATS event plane: it reads the KV events JetStream stored
and applies each worker's history when discovery adds the worker, instead of asking the worker
for a dump; a history with a hole (retention dropped its start) still falls back to asking."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest

from dynamo.protocol.kv_events import (
    KV_EVENTS_TOPIC,
    BlocksStored,
    KVCacheEvent,
    KVEventBatch,
    StoredBlock,
)
from dynamo.protocol.kv_wire import encode_batch
from dynamo.protocol.model_card import ModelCard
from dynamo.router.config import KVRouterSettings
from dynamo.router.hashing import local_block_hashes
from dynamo.router.kv_router import KVRouter
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.event_plane.nats import stored_stream_name
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub
from tests.fakes import make_card
from tests.servers import NatsServer

BLOCK = 16
ENDPOINT = EndpointId("stored", "backend", "generate")


def card(worker_id: int) -> ModelCard:
    return make_card(
        worker_id,
        namespace=ENDPOINT.namespace,
        component=ENDPOINT.component,
        endpoint=ENDPOINT.endpoint,
        kv_block_size=BLOCK,
    )


@pytest.fixture
async def runtimes(nats_server: NatsServer) -> AsyncIterator[list[DistributedRuntime]]:
    hub = InProcessHub()
    config = RuntimeConfig(
        namespace=ENDPOINT.namespace,
        discovery_backend="memory",
        request_plane="local",
        event_plane="nats",
        nats_server=nats_server.url,
    )
    made = [DistributedRuntime(config, hub) for _ in range(2)]
    for runtime in made:
        await runtime.start()
    yield made
    for runtime in made:
        await runtime.shutdown()


async def publish_chain(
    runtime: DistributedRuntime, worker_id: int, tokens: list[int], first_id: int
) -> None:
    """One stored-blocks event per block, ids from ``first_id``, parent-chained."""
    parent: int | None = None
    for i, tokens_hash in enumerate(local_block_hashes(tokens, BLOCK)):
        block_hash = worker_id * 1000 + i
        event = KVCacheEvent(
            event_id=first_id + i,
            data=BlocksStored(parent_hash=parent, blocks=[StoredBlock(block_hash, tokens_hash)]),
        )
        batch = KVEventBatch(worker_id=worker_id, events=[event])
        await runtime.events.publish(KV_EVENTS_TOPIC, encode_batch(batch))
        parent = block_hash


async def wait_stored(url: str, count: int) -> None:
    """Until the stream holds ``count`` messages: a publish only queues in the publisher's
    client, so the router (another connection) could otherwise start before the last ones are
    stored and receive them live instead, after the test's first look at its index."""
    client = await nats.connect(url)
    try:
        async with asyncio.timeout(10):
            while True:
                info = await client.jetstream().stream_info(stored_stream_name(ENDPOINT.namespace))
                if info.state.messages >= count:
                    return
                await asyncio.sleep(0.01)
    finally:
        await client.close()


async def test_late_router_applies_stored_events_without_asking_workers(
    runtimes: list[DistributedRuntime], nats_server: NatsServer
) -> None:
    worker, frontend = runtimes
    tokens = list(range(BLOCK * 6))
    await publish_chain(worker, 0xA1, tokens, first_id=0)
    await publish_chain(worker, 0xB2, tokens[: BLOCK * 3], first_id=7)  # its start is gone
    await worker.events.publish(KV_EVENTS_TOPIC, b"not a batch")  # skipped
    await wait_stored(nats_server.url, 6 + 3 + 1)
    router = await KVRouter.create(frontend, card(0xA1), KVRouterSettings())
    try:
        router.add_worker(card(0xA1))
        router.add_worker(card(0xB2))
        assert router.indexer is not None
        local = local_block_hashes(tokens, BLOCK)
        assert router.indexer.find_matches(local) == {(0xA1, 0): 6}
        assert router.indexer.last_event_id(0xA1) == 5
        assert not router.indexer.is_recovering(0xA1)
        # Only the worker with a hole in its stored history is asked for its state.
        tasks = router._tasks  # noqa: SLF001
        asked = sorted(t.get_name() for t in tasks if t.get_name().startswith("kv-recovery"))
        assert asked == ["kv-recovery:b2:0"]
    finally:
        await router.close()

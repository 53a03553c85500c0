"""The work-queue contract, run against every backend: pull/ack, bounded depth, redelivery of
unsettled items, nack, close, and many consumers taking each item once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.errors import Overloaded
from dynamo.runtime.nats_client import connect_nats
from dynamo.runtime.runtime import DistributedRuntime
from dynamo.runtime.work_queue.base import QueueDepth, WorkQueue
from dynamo.runtime.work_queue.jetstream import JetStreamWorkQueue
from dynamo.runtime.work_queue.local import LocalQueueStore, LocalWorkQueue
from tests.servers import NatsServer

# open_queue(max_depth, redelivery_timeout) -> a started handle on the test's one queue.
OpenQueue = Callable[[int, float], Awaitable[WorkQueue]]


@pytest.fixture(params=["local", "jetstream", "served"])
async def open_queue(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OpenQueue]:
    """Handles on one queue, each as a separate "process" (its own NATS connection; served:
    its own runtime on file discovery and the TCP request plane, the first one hosting)."""
    handles: list[WorkQueue] = []
    clients: list[NatsClient] = []
    runtimes: list[DistributedRuntime] = []
    store = LocalQueueStore()
    server: NatsServer | None = None
    if request.param == "jetstream":
        server = request.getfixturevalue("nats_server")

    async def open_(max_depth: int, redelivery_timeout: float) -> WorkQueue:
        queue: WorkQueue
        if request.param == "served":
            runtime = DistributedRuntime(
                RuntimeConfig(namespace="wq", discovery_dir=str(tmp_path), lease_ttl=5.0)
            )
            await runtime.start()
            runtimes.append(runtime)
            queue = await runtime.work_queue(
                "prefill",
                max_depth=max_depth,
                redelivery_timeout=redelivery_timeout,
                host=len(runtimes) == 1,
            )
            if len(runtimes) > 1:  # the host is in discovery before the handle is used
                await queue._client.wait_for_instances(1, timeout=5)  # type: ignore[attr-defined]
            handles.append(queue)
            return queue
        if server is None:
            queue = LocalWorkQueue(
                store, "prefill", max_depth=max_depth, redelivery_timeout=redelivery_timeout
            )
        else:
            client = await connect_nats(server.url)
            clients.append(client)
            queue = JetStreamWorkQueue(
                client, "prefill", max_depth=max_depth, redelivery_timeout=redelivery_timeout
            )
        await queue.start()
        handles.append(queue)
        return queue

    yield open_
    for handle in handles:
        await handle.close()
    for client in clients:
        await client.close()
    for runtime in reversed(runtimes):
        await runtime.shutdown()


async def test_fifo_pull_ack_and_depth(open_queue: OpenQueue) -> None:
    producer = await open_queue(8, 30.0)
    consumer = await open_queue(8, 30.0)
    assert await producer.depth() == QueueDepth(0, 0)
    for i in range(3):
        await producer.push(b"job%d" % i)
    assert await consumer.depth() == QueueDepth(waiting=3, in_flight=0)
    first = await consumer.pull(timeout=2)
    assert first is not None and first.payload == b"job0" and first.deliveries == 1
    assert await producer.depth() == QueueDepth(waiting=2, in_flight=1)
    await consumer.ack(first)
    assert (await producer.depth()).total == 2
    rest = [await consumer.pull(timeout=2) for _ in range(2)]
    assert [item.payload for item in rest if item is not None] == [b"job1", b"job2"]
    for item in rest:
        assert item is not None
        await consumer.ack(item)
    assert await producer.depth() == QueueDepth(0, 0)
    assert await consumer.pull(timeout=0.05) is None


async def test_push_beyond_max_depth_is_refused(open_queue: OpenQueue) -> None:
    queue = await open_queue(2, 30.0)
    await queue.push(b"a")
    await queue.push(b"b")
    with pytest.raises(Overloaded):
        await queue.push(b"c")
    item = await queue.pull(timeout=2)
    assert item is not None
    with pytest.raises(Overloaded):  # in flight still counts against the bound
        await queue.push(b"c")
    await queue.ack(item)
    await queue.push(b"c")
    assert (await queue.depth()).total == 2


async def test_unsettled_item_is_redelivered(open_queue: OpenQueue) -> None:
    slow = await open_queue(4, 0.3)
    other = await open_queue(4, 0.3)
    await slow.push(b"x")
    first = await slow.pull(timeout=2)
    assert first is not None and first.deliveries == 1
    # The slow consumer never settles it: after the timeout another consumer gets it again.
    again = await other.pull(timeout=5)
    assert again is not None and again.payload == b"x" and again.deliveries == 2
    await other.ack(again)
    assert await other.depth() == QueueDepth(0, 0)
    await slow.ack(first)  # late ack of a completed item: a no-op


async def test_late_ack_of_an_earlier_delivery_completes_the_item(open_queue: OpenQueue) -> None:
    slow = await open_queue(4, 0.3)
    other = await open_queue(4, 0.3)
    await slow.push(b"x")
    first = await slow.pull(timeout=2)
    again = await other.pull(timeout=5)
    assert first is not None and again is not None and again.deliveries == 2
    await slow.ack(first)  # the slow consumer did finish the work
    assert await other.depth() == QueueDepth(0, 0)
    await other.ack(again)
    assert await other.pull(timeout=0.5) is None


async def test_nack_redelivers_at_once(open_queue: OpenQueue) -> None:
    queue = await open_queue(4, 30.0)  # far longer than the test: no timeout redelivery
    await queue.push(b"x")
    await queue.push(b"y")
    item = await queue.pull(timeout=2)
    assert item is not None and item.payload == b"x"
    await queue.nack(item)
    # Back at once (JetStream may hand out the other waiting item first).
    got = [await queue.pull(timeout=5) for _ in range(2)]
    by_payload = {g.payload: g for g in got if g is not None}
    assert set(by_payload) == {b"x", b"y"}
    assert by_payload[b"x"].deliveries == 2
    for g in by_payload.values():
        await queue.ack(g)


async def test_waiting_pull_gets_a_later_push(open_queue: OpenQueue) -> None:
    consumer = await open_queue(4, 30.0)
    producer = await open_queue(4, 30.0)
    pending = asyncio.create_task(consumer.pull(timeout=5))
    await asyncio.sleep(0.05)
    await producer.push(b"late")
    item = await pending
    assert item is not None and item.payload == b"late"
    await consumer.ack(item)


async def test_many_consumers_take_each_item_once(open_queue: OpenQueue) -> None:
    producer = await open_queue(64, 30.0)
    consumers = [await open_queue(64, 30.0) for _ in range(3)]
    taken: list[bytes] = []

    async def consume(queue: WorkQueue) -> None:
        while (item := await queue.pull(timeout=0.5)) is not None:
            taken.append(item.payload)
            await queue.ack(item)

    workers = [asyncio.create_task(consume(c)) for c in consumers]
    for i in range(30):
        await producer.push(b"%d" % i)
    await asyncio.gather(*workers)
    assert sorted(taken) == sorted(b"%d" % i for i in range(30))
    assert await producer.depth() == QueueDepth(0, 0)


async def test_cancelled_pull_loses_no_item(open_queue: OpenQueue) -> None:
    queue = await open_queue(4, 30.0)
    pending = asyncio.create_task(queue.pull())
    await asyncio.sleep(0.05)
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    await queue.push(b"kept")
    # JetStream may already have handed it to the cancelled fetch's inbox: it is then in flight
    # to this handle, which gets it on its next pull (or another after the redelivery timeout).
    assert (await queue.depth()).total == 1
    item = await queue.pull(timeout=2)
    assert item is not None and item.payload == b"kept"
    await queue.ack(item)


async def test_close_wakes_pulls_and_gives_back_unsettled_items(open_queue: OpenQueue) -> None:
    leaving = await open_queue(4, 30.0)
    staying = await open_queue(4, 30.0)
    await staying.push(b"held")
    held = await leaving.pull(timeout=2)
    assert held is not None
    blocked = asyncio.create_task(leaving.pull())
    await asyncio.sleep(0.05)
    await leaving.close()
    assert await asyncio.wait_for(blocked, 2) is None
    again = await staying.pull(timeout=5)
    assert again is not None and again.payload == b"held" and again.deliveries == 2
    await staying.ack(again)


async def test_served_item_of_a_consumer_whose_connection_drops_comes_back_at_once(
    tmp_path: Path,
) -> None:
    """The host notices a consumer's death by its request-plane connection dropping (the
    consumer's process is gone) and gives back its item at once, long before the timeout."""
    runtimes: list[DistributedRuntime] = []
    for _ in range(3):
        runtime = DistributedRuntime(
            RuntimeConfig(namespace="wq", discovery_dir=str(tmp_path), lease_ttl=5.0)
        )
        await runtime.start()
        runtimes.append(runtime)
    try:
        host, dying, staying = [
            await rt.work_queue("prefill", max_depth=4, redelivery_timeout=60.0, host=i == 0)
            for i, rt in enumerate(runtimes)
        ]
        for handle in (dying, staying):
            await handle._client.wait_for_instances(1, timeout=5)  # type: ignore[attr-defined]
        await host.push(b"task")
        held = await dying.pull(timeout=2)
        assert held is not None and held.deliveries == 1
        assert await host.depth() == QueueDepth(0, 1)
        # The consumer "dies": its connections to the host drop with no nack sent.
        await runtimes[1].transport.close()
        again = await staying.pull(timeout=10)
        assert again is not None and again.payload == b"task" and again.deliveries == 2
        await staying.ack(again)
        assert await host.depth() == QueueDepth(0, 0)
        # An acked item stays acked: the finished hold gives nothing back.
        await host.push(b"next")
        item = await staying.pull(timeout=2)
        assert item is not None
        await staying.ack(item)
        await asyncio.sleep(0.2)
        assert await host.depth() == QueueDepth(0, 0)
    finally:
        for runtime in reversed(runtimes):
            await runtime.shutdown()


async def test_runtimes_of_one_hub_share_a_namespaced_queue() -> None:
    from dynamo.runtime.config import RuntimeConfig
    from dynamo.runtime.runtime import DistributedRuntime, InProcessHub

    hub = InProcessHub()
    config = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")
    frontend, worker = DistributedRuntime(config, hub), DistributedRuntime(config, hub)
    other_ns = DistributedRuntime(
        RuntimeConfig(
            namespace="other",
            discovery_backend="memory",
            request_plane="local",
            event_plane="local",
        ),
        hub,
    )
    for runtime in (frontend, worker, other_ns):
        await runtime.start()
    try:
        producer = await frontend.work_queue("prefill", max_depth=4)
        consumer = await worker.work_queue("prefill", max_depth=4)
        stranger = await other_ns.work_queue("prefill", max_depth=4)
        await producer.push(b"p")
        assert await stranger.pull(timeout=0.05) is None
        item = await consumer.pull(timeout=2)
        assert item is not None and item.payload == b"p"
        await consumer.ack(item)
    finally:
        for runtime in (frontend, worker, other_ns):
            await runtime.shutdown()

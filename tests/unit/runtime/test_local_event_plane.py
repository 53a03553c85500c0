"""LocalEventPlane on a shared LocalEventBus: prefixes, per-topic seq, bounded queues, close."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from dynamo.runtime.event_plane.base import EventMessage, Subscription
from dynamo.runtime.event_plane.local import LocalEventBus, LocalEventPlane


@pytest.fixture
def bus() -> LocalEventBus:
    return LocalEventBus()


@pytest.fixture
async def planes(bus: LocalEventBus) -> AsyncIterator[tuple[LocalEventPlane, LocalEventPlane]]:
    a, b = LocalEventPlane(bus), LocalEventPlane(bus, max_queue=8)
    await a.start()
    await b.start()
    yield a, b
    await a.close()
    await b.close()


async def recv(sub: Subscription, timeout: float = 2.0) -> EventMessage:
    async with asyncio.timeout(timeout):
        return await anext(aiter(sub))


async def test_publish_subscribe_by_prefix_with_seq_per_topic(
    planes: tuple[LocalEventPlane, LocalEventPlane],
) -> None:
    a, b = planes
    assert a.publisher_id != b.publisher_id
    kv = await b.subscribe("kv")
    everything = await b.subscribe("")
    await a.publish("kv-events", b"1")
    await a.publish("metrics", b"m")
    await a.publish("kv-events", b"2")
    await b.publish("kv-events", b"own")  # a plane also hears itself
    await a.publish("kv_metrics", b"3")
    got = [await recv(kv) for _ in range(4)]
    assert [(m.topic, m.publisher_id, m.seq, m.payload) for m in got] == [
        ("kv-events", a.publisher_id, 0, b"1"),
        ("kv-events", a.publisher_id, 1, b"2"),
        ("kv-events", b.publisher_id, 0, b"own"),
        ("kv_metrics", a.publisher_id, 0, b"3"),
    ]
    assert [(await recv(everything)).topic for _ in range(5)] == [
        "kv-events",
        "metrics",
        "kv-events",
        "kv-events",
        "kv_metrics",
    ]


async def test_slow_subscriber_drops_never_blocks_and_shows_a_gap(
    planes: tuple[LocalEventPlane, LocalEventPlane],
) -> None:
    a, b = planes
    slow = await b.subscribe("t")  # max_queue=8, never read during the burst
    fast = await a.subscribe("t")
    n = 5_000
    start = time.perf_counter()
    for i in range(n):
        await a.publish("t", i.to_bytes(4, "big"))
    assert time.perf_counter() - start < 5.0  # bounded by the publisher alone
    assert slow.dropped == n - 8  # type: ignore[attr-defined]
    assert fast.dropped == 0  # type: ignore[attr-defined]
    seqs = [(await recv(slow)).seq for _ in range(8)]  # drain, then one more gets through
    await a.publish("t", b"after")
    seqs.append((await recv(slow)).seq)
    assert seqs[:8] == list(range(8))
    assert seqs[8] == n  # the receiver sees the jump: seq 8..n-1 were lost
    gaps = [(x, y) for x, y in zip(seqs, seqs[1:], strict=False) if y != x + 1]
    assert gaps == [(7, n)]
    assert [(await recv(fast)).seq for _ in range(n + 1)] == list(range(n + 1))


async def test_close_ends_iteration_and_stops_delivery(
    bus: LocalEventBus, planes: tuple[LocalEventPlane, LocalEventPlane]
) -> None:
    a, b = planes
    sub = await b.subscribe("")
    waiter = asyncio.create_task(anext(aiter(sub), None), name="waiting-reader")
    await asyncio.sleep(0)
    await sub.close()
    assert await asyncio.wait_for(waiter, 2.0) is None  # a pending reader is released
    await a.publish("x", b"1")
    assert [m async for m in sub] == []
    other = await b.subscribe("")
    await b.close()
    assert [m async for m in other] == []
    assert bus._subscriptions == []  # nothing left registered on the bus
    with pytest.raises(RuntimeError):
        await b.publish("x", b"1")
    with pytest.raises(RuntimeError):
        await b.subscribe("")
    with pytest.raises(ValueError):
        LocalEventPlane(bus, max_queue=0)

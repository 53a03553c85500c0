"""The event-plane contract (``runtime/event_plane/base.py``), one suite that every backend runs:
``local`` (one process, a shared bus), ``zmq`` (real sockets on 127.0.0.1, publishers found
through discovery) and ``nats`` (a real nats-server started for the test). Each plane is a
separate "process" (its own bus handle, discovery client or NATS connection). What only one
backend has (ZMQ's advertisement records, NATS subjects and restarts) is tested in that
backend's own file."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from dynamo.runtime.discovery.memory import MemoryDiscovery, MemoryStore
from dynamo.runtime.event_plane.base import EventMessage, EventPlane
from dynamo.runtime.event_plane.local import LocalEventBus, LocalEventPlane
from dynamo.runtime.event_plane.nats import NatsEventPlane
from dynamo.runtime.event_plane.zmq import ZmqEventPlane
from dynamo.runtime.nats_client import connect_nats
from tests.unit.runtime.event_probe import recv_data, wait_connected

NS = "contract-ns"
MakePlane = Callable[..., Awaitable[EventPlane]]
"""``make(slow=False)``: a started plane; ``slow=True`` gives it small receive/send bounds."""


@pytest.fixture(params=["local", "zmq", "nats"])
async def make_plane(request: pytest.FixtureRequest) -> AsyncIterator[MakePlane]:
    closers: list[Callable[[], Awaitable[Any]]] = []
    bus, store = LocalEventBus(), MemoryStore()
    nats_url = request.getfixturevalue("nats_server").url if request.param == "nats" else ""

    async def make(slow: bool = False) -> EventPlane:
        plane: EventPlane
        if request.param == "local":
            plane = LocalEventPlane(bus, max_queue=8 if slow else 65_536)
        elif request.param == "zmq":
            disc = MemoryDiscovery(store)
            closers.append(disc.close)
            limits = {"sndhwm": 100, "rcvhwm": 100} if slow else {}
            plane = ZmqEventPlane(disc, NS, **limits)
        else:
            client = await connect_nats(nats_url)
            closers.append(client.close)
            plane = NatsEventPlane(client, NS, pending_msgs=100 if slow else 65_536)
        closers.append(plane.close)
        await plane.start()
        return plane

    yield make
    for close in reversed(closers):
        await close()


async def test_publish_subscribe_by_prefix_with_seq_per_topic(make_plane: MakePlane) -> None:
    a, b = await make_plane(), await make_plane()
    assert a.publisher_id != b.publisher_id
    kv = await b.subscribe("kv")
    everything = await b.subscribe("")
    for plane in (a, b):  # b hears its own publisher too
        await wait_connected(plane, kv, "kv")
        await wait_connected(plane, everything, "")
    await a.publish("kv-events", b"1")
    await a.publish("metrics", b"m")
    await a.publish("kv-events", b"2")
    await b.publish("kv-events", b"own")
    await a.publish("kv_metrics", b"3")
    got = [await recv_data(kv) for _ in range(4)]
    # Ordered per publisher and topic; publishers interleave as the transport delivers them.
    assert sorted((m.publisher_id, m.topic, m.seq, m.payload) for m in got) == sorted(
        [
            (a.publisher_id, "kv-events", 0, b"1"),
            (a.publisher_id, "kv-events", 1, b"2"),
            (b.publisher_id, "kv-events", 0, b"own"),
            (a.publisher_id, "kv_metrics", 0, b"3"),
        ]
    )
    assert [m.payload for m in got if m.publisher_id == a.publisher_id][:2] == [b"1", b"2"]
    topics = sorted([(await recv_data(everything)).topic for _ in range(5)])
    assert topics == sorted(["kv-events", "metrics", "kv-events", "kv-events", "kv_metrics"])


async def test_a_publisher_that_appears_later_is_heard(make_plane: MakePlane) -> None:
    a = await make_plane()
    sub = await a.subscribe("t")
    late = await make_plane()  # appears after the subscription
    await wait_connected(late, sub, "t")
    await late.publish("t-x", b"hello")
    assert await recv_data(sub) == EventMessage("t-x", late.publisher_id, 0, b"hello")


async def test_slow_subscriber_never_blocks_the_publisher_and_gaps_show(
    make_plane: MakePlane,
) -> None:
    publisher, reader = await make_plane(slow=True), await make_plane(slow=True)
    slow = await reader.subscribe("t")
    await wait_connected(publisher, slow, "t")
    payload = b"x" * 4096
    n = 20_000  # ~80 MB, never read during the burst: beyond every bound and socket buffer
    start = time.perf_counter()
    for _ in range(n):
        await publisher.publish("t-data", payload)
    elapsed = time.perf_counter() - start
    assert elapsed < 20.0, f"publisher was held up: {elapsed:.1f}s"  # generous: loaded CI
    seqs: list[int] = []
    while True:  # drain what survived, then one marker message
        try:
            seqs.append((await recv_data(slow, timeout=0.5)).seq)
        except TimeoutError:
            break
    await publisher.publish("t-data", b"end")
    marker = await recv_data(slow)
    assert marker.payload == b"end" and marker.seq == n
    seqs.append(marker.seq)
    assert len(seqs) < n + 1  # messages were dropped ...
    assert seqs == sorted(seqs) and seqs[0] == 0
    gaps = [(x, y) for x, y in zip(seqs, seqs[1:], strict=False) if y != x + 1]
    assert gaps  # ... and the receiver can tell from the sequence numbers


async def test_close_ends_iteration_and_stops_delivery(make_plane: MakePlane) -> None:
    a, b = await make_plane(), await make_plane()
    sub = await b.subscribe("t")
    await wait_connected(a, sub, "t")
    reader = asyncio.create_task(anext(aiter(sub), None), name="pending-reader")
    await asyncio.sleep(0.01)
    await sub.close()
    assert await asyncio.wait_for(reader, 2.0) is None  # a pending reader is released
    await a.publish("t-x", b"after")
    assert [m async for m in sub] == []
    # another prefix: over NATS the "after" publish may still be in flight and would reach a
    # new "t" subscription (the point here is only that closing the plane ends it)
    other = await b.subscribe("u")
    reader = asyncio.create_task(anext(aiter(other), None), name="pending-reader-2")
    await asyncio.sleep(0.01)
    await b.close()
    await b.close()  # idempotent
    assert await asyncio.wait_for(reader, 2.0) is None  # closing the plane ends its subscriptions
    assert [m async for m in other] == []
    with pytest.raises(RuntimeError):
        await b.publish("t-x", b"closed")
    with pytest.raises(RuntimeError):
        await b.subscribe("t")

"""ZmqEventPlane over real sockets on 127.0.0.1: what only ZMQ has (publishers advertised in and
withdrawn from memory/file discovery, malformed frames, one connection per endpoint, a clean
close). The event-plane contract itself runs against it in ``test_event_plane_contract.py``."""

from __future__ import annotations

import asyncio
import gc
import struct
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from dynamo.runtime.discovery.file import FileDiscovery
from dynamo.runtime.discovery.memory import MemoryDiscovery, MemoryStore
from dynamo.runtime.event_plane.base import EventMessage
from dynamo.runtime.event_plane.zmq import PublisherInfo, ZmqEventPlane, ZmqSubscription
from dynamo.runtime.naming import event_publishers_prefix
from tests.unit.runtime.event_probe import recv, recv_data
from tests.unit.runtime.event_probe import wait_connected as probe_connected

NS = "test-ns"
MakePlane = Callable[..., Awaitable[ZmqEventPlane]]


@pytest.fixture
async def make_plane() -> AsyncIterator[MakePlane]:
    """Planes of separate "processes": each with its own MemoryDiscovery on one shared store."""
    store = MemoryStore()
    created: list[tuple[ZmqEventPlane, MemoryDiscovery]] = []

    async def make(**kwargs: Any) -> ZmqEventPlane:
        disc = MemoryDiscovery(store)
        plane = ZmqEventPlane(disc, NS, **kwargs)
        created.append((plane, disc))
        await plane.start()
        return plane

    yield make
    for plane, disc in reversed(created):
        await plane.close()
        await disc.close()


async def wait_connected(publisher: ZmqEventPlane, sub: ZmqSubscription) -> None:
    await probe_connected(publisher, sub, sub.prefix)


async def test_late_publisher_is_discovered_and_dropped(make_plane: MakePlane) -> None:
    a = await make_plane()
    sub = await a.subscribe("t/")
    late = await make_plane()  # appears after the subscription
    await wait_connected(late, sub)
    await late.publish("t/x", b"hello")
    assert (await recv_data(sub)) == EventMessage("t/x", late.publisher_id, 0, b"hello")
    assert late.endpoint in a._publishers.values()
    await late.close()  # withdrawn from discovery: the subscriber disconnects
    async with asyncio.timeout(5.0):
        while late.endpoint in a._publishers.values():
            await asyncio.sleep(0.01)


async def test_advertised_in_file_discovery_and_withdrawn(tmp_path: Path) -> None:
    disc_a = FileDiscovery(tmp_path, poll_interval=0.02)
    disc_b = FileDiscovery(tmp_path, poll_interval=0.02)
    lease = await disc_a.grant_lease(5.0)
    a = ZmqEventPlane(disc_a, NS, lease=lease)
    b = ZmqEventPlane(disc_b, NS)  # no lease given: it owns one
    try:
        await a.start()
        sub = await a.subscribe("t/")
        await b.start()
        records = await disc_a.get_prefix(event_publishers_prefix(NS))
        infos = {msgspec.json.decode(kv.value, type=PublisherInfo) for kv in records}
        assert infos == {
            PublisherInfo(a.publisher_id, a.endpoint or ""),
            PublisherInfo(b.publisher_id, b.endpoint or ""),
        }
        assert {kv.key for kv in records} == {
            f"{event_publishers_prefix(NS)}{p.publisher_id:x}" for p in (a, b)
        }
        await wait_connected(b, sub)  # found by polling the shared directory
        await b.publish("t/file", b"via file discovery")
        assert (await recv_data(sub)).payload == b"via file discovery"
        await b.close()
        assert [kv.key for kv in await disc_a.get_prefix(event_publishers_prefix(NS))] == [
            f"{event_publishers_prefix(NS)}{a.publisher_id:x}"
        ]
        await a.close()
        assert await disc_a.get_prefix(event_publishers_prefix(NS)) == []
        assert lease.is_alive()  # a given lease stays the caller's
    finally:
        await a.close()
        await b.close()
        await disc_a.close()
        await disc_b.close()


async def test_malformed_frames_are_skipped(make_plane: MakePlane) -> None:
    plane = await make_plane()
    sub = await plane.subscribe("t/")
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        port = raw.bind_to_random_port("tcp://127.0.0.1")
        info = PublisherInfo(publisher_id=7, endpoint=f"tcp://127.0.0.1:{port}")
        await plane._discovery.put(f"{event_publishers_prefix(NS)}7", msgspec.json.encode(info))
        good = [b"t/ok", struct.pack(">QQ", 7, 0), b"fine"]
        async with asyncio.timeout(15.0):
            while True:
                raw.send_multipart([b"t/bad", b"short-header", b""])
                raw.send_multipart([b"t/bad2"])
                raw.send_multipart(good)
                try:
                    message = await recv(sub, timeout=0.05)
                except TimeoutError:
                    continue
                break
        assert message == EventMessage("t/ok", 7, 0, b"fine")
        assert isinstance(sub, ZmqSubscription) and sub.malformed == 2
    finally:
        raw.close()
        ctx.term()


async def test_close_is_clean(make_plane: MakePlane) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plane = await make_plane()
        sub = await plane.subscribe("t/")
        await wait_connected(plane, sub)
        reader = asyncio.create_task(anext(aiter(sub), None), name="pending-reader")
        await asyncio.sleep(0.01)
        await sub.close()
        assert await asyncio.wait_for(reader, 2.0) is None  # a pending recv is released
        assert [m async for m in sub] == []
        other = await plane.subscribe("t/")
        reader = asyncio.create_task(anext(aiter(other), None), name="pending-reader-2")
        await asyncio.sleep(0.01)
        await plane.close()
        await plane.close()  # idempotent
        assert await asyncio.wait_for(reader, 2.0) is None
        assert plane._pub is None and plane._ctx is None and plane._follower is None
        assert await plane._discovery.get_prefix(event_publishers_prefix(NS)) == []
        with pytest.raises(RuntimeError):
            await plane.publish("t/x", b"")
        with pytest.raises(RuntimeError):
            await plane.subscribe("t/")
        del sub, other, reader
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_endpoint_under_two_keys_is_connected_once(make_plane: MakePlane) -> None:
    publisher = await make_plane()
    reader = await make_plane()
    sub = await reader.subscribe("t/")
    await wait_connected(publisher, sub)
    # A stale record of a dead publisher whose port the live one reused.
    stale_key = f"{event_publishers_prefix(NS)}dead"
    info = PublisherInfo(publisher_id=1, endpoint=publisher.endpoint or "")
    await reader._discovery.put(stale_key, msgspec.json.encode(info))
    await asyncio.sleep(0.1)
    await publisher.publish("t/once", b"1")
    assert (await recv_data(sub)).payload == b"1"
    with pytest.raises(TimeoutError):
        await recv_data(sub, timeout=0.3)  # no duplicate copy
    await reader._discovery.delete(stale_key)  # the live publisher's own record remains
    await asyncio.sleep(0.1)
    await publisher.publish("t/once", b"2")
    assert (await recv_data(sub)).payload == b"2"

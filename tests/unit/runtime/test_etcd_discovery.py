"""EtcdDiscovery against a real etcd: the etcd-shaped contract the memory and file backends pass,
plus etcd's own faults (restart mid-run, a hung owner's lease expiring)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamo.runtime.discovery.base import KeyValue, Watch, WatchEvent, WatchEventKind
from dynamo.runtime.discovery.etcd import EtcdDiscovery
from dynamo.runtime.discovery.etcd_gateway import prefix_range_end
from dynamo.runtime.errors import CannotConnect, InvalidArgument
from tests.servers import EtcdServer

PUT, DELETE = WatchEventKind.PUT, WatchEventKind.DELETE


@pytest.fixture
async def disc(etcd_server: EtcdServer) -> AsyncIterator[EtcdDiscovery]:
    d = EtcdDiscovery([etcd_server.endpoint])
    yield d
    await d.close()


async def next_event(watch: Watch, timeout: float = 5.0) -> WatchEvent:
    async with asyncio.timeout(timeout):
        return await anext(aiter(watch))


async def no_event(watch: Watch, wait: float = 0.3) -> bool:
    try:
        await next_event(watch, timeout=wait)
    except TimeoutError:
        return True
    return False


def test_prefix_range_end() -> None:
    assert prefix_range_end(b"a/") == b"a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"") == b"\0"


async def test_put_get_get_prefix_delete(disc: EtcdDiscovery) -> None:
    await disc.put("a/1", b"one")
    await disc.put("a/2", b"two")
    await disc.put("b/1", b"other")
    assert await disc.get("a/1") == KeyValue("a/1", b"one")
    assert await disc.get("missing") is None
    assert [kv.key for kv in await disc.get_prefix("a/")] == ["a/1", "a/2"]
    assert len(await disc.get_prefix("")) == 3
    await disc.put("a/1", b"uno")
    assert (await disc.get("a/1")) == KeyValue("a/1", b"uno")
    await disc.delete("a/1")
    await disc.delete("a/1")  # deleting a missing key is a no-op
    assert await disc.get("a/1") is None
    assert [kv.key for kv in await disc.get_prefix("a/")] == ["a/2"]
    with pytest.raises(InvalidArgument):
        await disc.put("", b"x")
    with pytest.raises(InvalidArgument):
        await disc.grant_lease(0)


async def test_revoke_deletes_lease_keys_and_rebinding(disc: EtcdDiscovery) -> None:
    lease = await disc.grant_lease(5.0)
    other = await disc.grant_lease(5.0)
    assert lease.is_alive() and lease.ttl >= 5.0
    await disc.put("k/leased", b"1", lease)
    await disc.put("k/free", b"2")
    await disc.put("k/moved", b"3", lease)
    await disc.put("k/moved", b"4", other)  # now owned by the other lease
    assert (await disc.get("k/leased")) == KeyValue("k/leased", b"1", lease.id)
    await lease.revoke()
    await lease.revoke()  # idempotent
    assert not lease.is_alive()
    assert await disc.get("k/leased") is None
    assert await disc.get("k/free") is not None
    assert (await disc.get("k/moved")) == KeyValue("k/moved", b"4", other.id)
    with pytest.raises(InvalidArgument):
        await disc.put("k/again", b"x", lease)


async def test_watch_snapshot_then_ordered_events(disc: EtcdDiscovery) -> None:
    lease = await disc.grant_lease(5.0)
    await disc.put("w/a", b"1", lease)
    await disc.put("x/ignored", b"0")
    watch = await disc.watch_prefix("w/")
    assert watch.snapshot == [KeyValue("w/a", b"1", lease.id)]
    await disc.put("w/b", b"2")
    await disc.put("x/other", b"0")  # outside the prefix
    await disc.put("w/a", b"3", lease)
    await disc.delete("w/b")
    await lease.revoke()
    got = [await next_event(watch) for _ in range(4)]
    assert got == [
        WatchEvent(PUT, "w/b", b"2"),
        WatchEvent(PUT, "w/a", b"3"),
        WatchEvent(DELETE, "w/b"),
        WatchEvent(DELETE, "w/a"),
    ]
    assert await no_event(watch)
    await watch.close()
    assert [e async for e in watch] == []


async def test_every_key_of_an_expiring_lease_is_seen(disc: EtcdDiscovery) -> None:
    """A lease's keys go in one revision: the watch must deliver each of them."""
    lease = await disc.grant_lease(5.0)
    for i in range(5):
        await disc.put(f"many/{i}", b"x", lease)
    watch = await disc.watch_prefix("many/")
    await lease.revoke()
    got = sorted([(await next_event(watch)).key for _ in range(5)])
    assert got == [f"many/{i}" for i in range(5)]


async def test_two_clients_see_each_other(etcd_server: EtcdServer) -> None:
    a, b = EtcdDiscovery([etcd_server.endpoint]), EtcdDiscovery([etcd_server.endpoint])
    try:
        lease_a = await a.grant_lease(5.0)
        await a.put("peers/a", b"A", lease_a)
        watch_a = await a.watch_prefix("peers/")
        watch_b = await b.watch_prefix("peers/")
        assert [kv.key for kv in watch_b.snapshot] == ["peers/a"]
        lease_b = await b.grant_lease(5.0)
        await b.put("peers/b", b"B", lease_b)
        assert await next_event(watch_a) == WatchEvent(PUT, "peers/b", b"B")
        assert await next_event(watch_b) == WatchEvent(PUT, "peers/b", b"B")
        await b.close()  # b "exits": its lease is revoked, a sees the delete
        assert await next_event(watch_a) == WatchEvent(DELETE, "peers/b")
        assert [e async for e in watch_b] == []  # b's watches end with it
        assert [kv.key for kv in await a.get_prefix("peers/")] == ["peers/a"]
    finally:
        await a.close()
        await b.close()
    with pytest.raises(CannotConnect):
        await a.get("peers/a")


async def test_hung_owner_is_gone_within_the_ttl(disc: EtcdDiscovery) -> None:
    lease = await disc.grant_lease(2.0)
    healthy = await disc.grant_lease(2.0)
    await disc.put("hung/key", b"x", lease)
    await disc.put("healthy/key", b"y", healthy)
    watch = await disc.watch_prefix("hung/")
    lease.suspend_keepalive()
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await next_event(watch, timeout=lease.ttl + 5.0) == WatchEvent(DELETE, "hung/key")
    # etcd checks expiry every ~500 ms: within the TTL plus that tick and a loaded machine.
    assert loop.time() - start <= lease.ttl + 3.0
    assert not lease.is_alive()
    assert healthy.is_alive() and (await disc.get("healthy/key")) is not None


async def test_etcd_restart_resumes_watches_without_loss_or_duplicates(
    etcd_server: EtcdServer,
) -> None:
    worker, frontend = EtcdDiscovery([etcd_server.endpoint]), EtcdDiscovery([etcd_server.endpoint])
    try:
        lease = await worker.grant_lease(3.0)
        await worker.put("v1/instances/w1", b"1", lease)
        watch = await frontend.watch_prefix("v1/instances/")
        assert [kv.key for kv in watch.snapshot] == ["v1/instances/w1"]
        await worker.put("v1/instances/w2", b"2", lease)
        assert await next_event(watch) == WatchEvent(PUT, "v1/instances/w2", b"2")

        await asyncio.to_thread(etcd_server.restart)
        # A change made while the watch reconnects is delivered once; none is replayed.
        await worker.put("v1/instances/w3", b"3", lease)
        assert await next_event(watch, timeout=15) == WatchEvent(PUT, "v1/instances/w3", b"3")
        assert await no_event(watch, wait=1.0)
        await asyncio.sleep(lease.ttl / 3 + 1)  # a keepalive after the restart
        assert lease.is_alive()
        assert [kv.key for kv in await frontend.get_prefix("v1/instances/")] == [
            "v1/instances/w1",
            "v1/instances/w2",
            "v1/instances/w3",
        ]
        await worker.delete("v1/instances/w1")
        assert await next_event(watch) == WatchEvent(DELETE, "v1/instances/w1")
    finally:
        await worker.close()
        await frontend.close()

"""MemoryDiscovery over a shared MemoryStore: the etcd-shaped contract in one process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamo.runtime.discovery.base import KeyValue, Watch, WatchEvent, WatchEventKind
from dynamo.runtime.discovery.memory import MemoryDiscovery, MemoryStore
from dynamo.runtime.errors import CannotConnect, InvalidArgument

PUT, DELETE = WatchEventKind.PUT, WatchEventKind.DELETE


@pytest.fixture
async def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
async def disc(store: MemoryStore) -> AsyncIterator[MemoryDiscovery]:
    d = MemoryDiscovery(store)
    yield d
    await d.close()


async def next_event(watch: Watch, timeout: float = 2.0) -> WatchEvent:
    async with asyncio.timeout(timeout):
        return await anext(aiter(watch))


def pending(watch: Watch) -> bool:
    """True if an event is ready without waiting."""
    queue = watch._queue  # type: ignore[attr-defined]
    return not queue.empty()


async def test_put_get_get_prefix_delete(disc: MemoryDiscovery) -> None:
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


async def test_empty_key_and_bad_ttl_rejected(disc: MemoryDiscovery) -> None:
    with pytest.raises(InvalidArgument):
        await disc.put("", b"x")
    with pytest.raises(InvalidArgument):
        await disc.grant_lease(0)


async def test_revoke_deletes_lease_keys_only(disc: MemoryDiscovery) -> None:
    lease = await disc.grant_lease(5.0)
    assert lease.is_alive() and lease.ttl == 5.0
    await disc.put("k/leased", b"1", lease)
    await disc.put("k/free", b"2")
    assert (await disc.get("k/leased")) == KeyValue("k/leased", b"1", lease.id)
    await lease.revoke()
    await lease.revoke()  # idempotent
    assert not lease.is_alive()
    assert await disc.get("k/leased") is None
    assert await disc.get("k/free") is not None
    with pytest.raises(InvalidArgument):
        await disc.put("k/again", b"x", lease)


async def test_rebinding_a_key_to_another_lease(disc: MemoryDiscovery) -> None:
    first = await disc.grant_lease(5.0)
    second = await disc.grant_lease(5.0)
    await disc.put("k", b"1", first)
    await disc.put("k", b"2", second)
    await first.revoke()  # no longer owns "k"
    assert (await disc.get("k")) == KeyValue("k", b"2", second.id)
    await second.revoke()
    assert await disc.get("k") is None


async def test_watch_snapshot_then_ordered_events(disc: MemoryDiscovery) -> None:
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
    assert not pending(watch)
    await watch.close()
    assert [e async for e in watch] == []


async def test_two_clients_see_each_other(store: MemoryStore) -> None:
    a, b = MemoryDiscovery(store), MemoryDiscovery(store)
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
        assert (await a.get("peers/b")) is not None
        await b.close()  # b "exits": its lease is revoked, a sees the delete
        assert await next_event(watch_a) == WatchEvent(DELETE, "peers/b")
        assert [e async for e in watch_b] == []  # b's watches end with it
        assert [kv.key for kv in await a.get_prefix("peers/")] == ["peers/a"]
    finally:
        await a.close()
        await b.close()
    with pytest.raises(CannotConnect):
        await a.get("peers/a")
    assert await MemoryDiscovery(store).get_prefix("") == []


async def test_lease_expires_after_ttl_when_keepalive_stops(disc: MemoryDiscovery) -> None:
    ttl = 0.3
    lease = await disc.grant_lease(ttl)
    healthy = await disc.grant_lease(ttl)
    await disc.put("hung/key", b"x", lease)
    await disc.put("healthy/key", b"y", healthy)
    watch = await disc.watch_prefix("hung/")
    await asyncio.sleep(ttl * 2)  # keepalive holds both beyond the TTL
    assert lease.is_alive() and (await disc.get("hung/key")) is not None
    lease.suspend_keepalive()
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await next_event(watch, timeout=ttl + 2.0) == WatchEvent(DELETE, "hung/key")
    assert loop.time() - start <= ttl + 1.0
    assert not lease.is_alive()
    assert healthy.is_alive() and (await disc.get("healthy/key")) is not None

"""The discovery contract (``runtime/discovery/base.py``), one suite that every backend runs:
``memory`` (one process, a shared MemoryStore), ``file`` (a shared directory) and ``etcd`` (a
real etcd server started for the test). Each test's clients are separate "processes" sharing
one store. What only one backend has (file names on disk, etcd restarts) is tested in that
backend's own file."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dynamo.runtime.discovery.base import Discovery, KeyValue, WatchEvent, WatchEventKind
from dynamo.runtime.discovery.etcd import EtcdDiscovery
from dynamo.runtime.discovery.file import FileDiscovery
from dynamo.runtime.discovery.memory import MemoryDiscovery, MemoryStore
from dynamo.runtime.errors import CannotConnect, InvalidArgument
from tests.unit.runtime.discovery_kit import next_event, no_event

PUT, DELETE = WatchEventKind.PUT, WatchEventKind.DELETE


@dataclass
class Backend:
    """Clients of one shared store, and the backend's timing: the shortest lease TTL it honours
    and how late past the TTL an expiry may be seen (file: one poll; etcd: its ~500 ms expiry
    tick and whole-second TTLs; both on a loaded machine)."""

    name: str
    make: Callable[[], Discovery]
    short_ttl: float
    expiry_slack: float
    clients: list[Discovery] = field(default_factory=list)

    def client(self) -> Discovery:
        disc = self.make()
        self.clients.append(disc)
        return disc


@pytest.fixture(params=["memory", "file", "etcd"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "memory":
        store = MemoryStore()
        b = Backend("memory", lambda: MemoryDiscovery(store), 0.3, 1.0)
    elif request.param == "file":
        b = Backend("file", lambda: FileDiscovery(tmp_path, poll_interval=0.02), 0.6, 1.0)
    else:
        endpoint = request.getfixturevalue("etcd_server").endpoint
        b = Backend("etcd", lambda: EtcdDiscovery([endpoint]), 2.0, 3.0)
    yield b
    for disc in reversed(b.clients):
        await disc.close()


async def test_put_get_get_prefix_delete(backend: Backend) -> None:
    disc = backend.client()
    await disc.put("a/1", b"one")
    await disc.put("a/2", b"two")
    await disc.put("b/1", b"other")
    assert await disc.get("a/1") == KeyValue("a/1", b"one")
    assert await disc.get("missing") is None
    assert [kv.key for kv in await disc.get_prefix("a/")] == ["a/1", "a/2"]
    assert len(await disc.get_prefix("")) == 3
    await disc.put("a/1", b"uno")
    assert await disc.get("a/1") == KeyValue("a/1", b"uno")
    await disc.delete("a/1")
    await disc.delete("a/1")  # deleting a missing key is a no-op
    assert await disc.get("a/1") is None
    assert [kv.key for kv in await disc.get_prefix("a/")] == ["a/2"]


async def test_empty_key_and_bad_ttl_rejected(backend: Backend) -> None:
    disc = backend.client()
    with pytest.raises(InvalidArgument):
        await disc.put("", b"x")
    with pytest.raises(InvalidArgument):
        await disc.grant_lease(0)


async def test_revoke_deletes_lease_keys_only(backend: Backend) -> None:
    disc = backend.client()
    lease = await disc.grant_lease(5.0)
    assert lease.is_alive() and lease.ttl >= 5.0  # etcd may round a TTL up
    await disc.put("k/leased", b"1", lease)
    await disc.put("k/free", b"2")
    assert await disc.get("k/leased") == KeyValue("k/leased", b"1", lease.id)
    await lease.revoke()
    await lease.revoke()  # idempotent
    assert not lease.is_alive()
    assert await disc.get("k/leased") is None
    assert await disc.get("k/free") is not None
    with pytest.raises(InvalidArgument):
        await disc.put("k/again", b"x", lease)


async def test_rebinding_a_key_to_another_lease(backend: Backend) -> None:
    disc = backend.client()
    first = await disc.grant_lease(5.0)
    second = await disc.grant_lease(5.0)
    await disc.put("k", b"1", first)
    await disc.put("k", b"2", second)
    await first.revoke()  # no longer owns "k"
    assert await disc.get("k") == KeyValue("k", b"2", second.id)
    await second.revoke()
    assert await disc.get("k") is None


async def test_watch_snapshot_then_ordered_events(backend: Backend) -> None:
    disc = backend.client()
    lease = await disc.grant_lease(5.0)
    await disc.put("w/a", b"1", lease)
    await disc.put("x/ignored", b"0")
    watch = await disc.watch_prefix("w/")
    assert watch.snapshot == [KeyValue("w/a", b"1", lease.id)]
    # One change at a time: the file backend coalesces changes between two of its polls.
    await disc.put("w/b", b"2")
    assert await next_event(watch) == WatchEvent(PUT, "w/b", b"2")
    await disc.put("x/other", b"0")  # outside the prefix
    await disc.put("w/a", b"3", lease)
    assert await next_event(watch) == WatchEvent(PUT, "w/a", b"3")
    await disc.delete("w/b")
    assert await next_event(watch) == WatchEvent(DELETE, "w/b")
    await lease.revoke()
    assert await next_event(watch) == WatchEvent(DELETE, "w/a")
    assert await no_event(watch)  # no stray events
    await watch.close()
    assert [e async for e in watch] == []


async def test_every_key_of_a_revoked_lease_is_seen(backend: Backend) -> None:
    """A lease's keys go together (etcd: in one revision): the watch delivers each of them."""
    disc = backend.client()
    lease = await disc.grant_lease(5.0)
    for i in range(5):
        await disc.put(f"many/{i}", b"x", lease)
    watch = await disc.watch_prefix("many/")
    await lease.revoke()
    got = sorted([(await next_event(watch)).key for _ in range(5)])
    assert got == [f"many/{i}" for i in range(5)]
    assert await no_event(watch)


async def test_two_clients_see_each_other(backend: Backend) -> None:
    a, b = backend.client(), backend.client()
    lease_a = await a.grant_lease(5.0)
    await a.put("peers/a", b"A", lease_a)
    watch_a = await a.watch_prefix("peers/")
    watch_b = await b.watch_prefix("peers/")
    assert [kv.key for kv in watch_b.snapshot] == ["peers/a"]
    lease_b = await b.grant_lease(5.0)
    await b.put("peers/b", b"B", lease_b)
    assert await next_event(watch_a) == WatchEvent(PUT, "peers/b", b"B")
    assert await next_event(watch_b) == WatchEvent(PUT, "peers/b", b"B")
    assert await a.get("peers/b") == KeyValue("peers/b", b"B", lease_b.id)
    await b.close()  # b "exits": its lease is revoked, a sees the delete
    assert await next_event(watch_a) == WatchEvent(DELETE, "peers/b")
    assert [e async for e in watch_b] == []  # b's watches end with it
    assert [kv.key for kv in await a.get_prefix("peers/")] == ["peers/a"]
    with pytest.raises(CannotConnect):
        await b.get("peers/a")
    await b.close()  # idempotent


async def test_hung_owner_is_gone_within_the_ttl(backend: Backend) -> None:
    """An owner whose keepalives stop (its loop hung) loses its keys within the TTL; a healthy
    lease next to it is kept alive beyond its TTL."""
    disc, peer = backend.client(), backend.client()
    ttl = backend.short_ttl
    lease = await peer.grant_lease(ttl)
    healthy = await peer.grant_lease(ttl)
    await peer.put("hung/key", b"x", lease)
    await peer.put("healthy/key", b"y", healthy)
    watch = await disc.watch_prefix("hung/")
    await asyncio.sleep(ttl * 1.5)  # the keepalive holds both beyond the TTL
    assert lease.is_alive() and await disc.get("hung/key") is not None
    lease.suspend_keepalive()  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()
    start = loop.time()
    timeout = lease.ttl + backend.expiry_slack + 2.0
    assert await next_event(watch, timeout=timeout) == WatchEvent(DELETE, "hung/key")
    assert loop.time() - start <= lease.ttl + backend.expiry_slack
    assert await disc.get("hung/key") is None
    if backend.name != "file":  # file: the task that keeps a lease is the one that checks it
        async with asyncio.timeout(backend.expiry_slack + 2.0):
            while lease.is_alive():  # the owner learns it lost the lease
                await asyncio.sleep(0.02)
    assert healthy.is_alive() and await disc.get("healthy/key") is not None

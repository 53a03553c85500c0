"""PrefixFollower over MemoryDiscovery: snapshot as puts, events in order, sync and async
handlers, a failing handler does not stop it, nothing applied after close."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.runtime.discovery.follower import PrefixFollower
from dynamo.runtime.discovery.memory import MemoryDiscovery, MemoryStore


async def settle(seen: list[tuple[str, ...]], count: int) -> None:
    async with asyncio.timeout(5):
        while len(seen) < count:
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("handlers", ["sync", "async"])
async def test_snapshot_then_events_in_order(handlers: str) -> None:
    disc = MemoryDiscovery(MemoryStore())
    seen: list[tuple[str, ...]] = []

    def put(key: str, value: bytes) -> None:
        if value == b"bad":
            raise ValueError("malformed")
        seen.append(("put", key, value.decode()))

    def delete(key: str) -> None:
        seen.append(("delete", key))

    async def aput(key: str, value: bytes) -> None:
        await asyncio.sleep(0.001)  # an awaited handler finishes before the next event
        put(key, value)

    async def adelete(key: str) -> None:
        await asyncio.sleep(0.001)
        delete(key)

    await disc.put("p/a", b"1")
    await disc.put("p/b", b"2")
    await disc.put("q/x", b"outside")
    follower = (
        PrefixFollower(disc, "p/", put, delete)
        if handlers == "sync"
        else PrefixFollower(disc, "p/", aput, adelete, name="test-follower")
    )
    await follower.start()
    assert seen == [("put", "p/a", "1"), ("put", "p/b", "2")]  # applied before start returns
    with pytest.raises(RuntimeError):
        await follower.start()
    await disc.put("p/c", b"bad")  # the handler raises: logged, the follower goes on
    await disc.put("p/a", b"3")
    await disc.delete("p/b")
    await disc.put("q/y", b"outside")
    await disc.put("p/d", b"4")
    await settle(seen, 5)
    assert seen[2:] == [("put", "p/a", "3"), ("delete", "p/b"), ("put", "p/d", "4")]
    await follower.close()
    await follower.close()  # idempotent
    await disc.put("p/e", b"5")
    await asyncio.sleep(0.05)
    assert len(seen) == 5  # nothing after close
    await disc.close()


async def test_close_before_start_and_discovery_closing_under_it() -> None:
    store = MemoryStore()
    disc = MemoryDiscovery(store)
    seen: list[tuple[str, ...]] = []
    never = PrefixFollower(disc, "p/", lambda k, v: None, lambda k: None)
    await never.close()  # nothing started: nothing to do
    follower = PrefixFollower(disc, "p/", lambda k, v: seen.append((k,)), lambda k: None)
    await follower.start()
    await disc.close()  # the watch ends with its backend: the follower's task just finishes
    await asyncio.sleep(0.01)
    await follower.close()
    assert seen == []

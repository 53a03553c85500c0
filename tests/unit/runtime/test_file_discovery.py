"""FileDiscovery: the etcd-shaped contract over a shared directory (clients in one process)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo.runtime.discovery.base import KeyValue, Watch, WatchEvent, WatchEventKind
from dynamo.runtime.discovery.file import FileDiscovery
from dynamo.runtime.discovery.file_view import DirView, key_filename
from dynamo.runtime.errors import CannotConnect, InvalidArgument

PUT, DELETE = WatchEventKind.PUT, WatchEventKind.DELETE
POLL = 0.02


@pytest.fixture
async def disc(tmp_path: Path) -> AsyncIterator[FileDiscovery]:
    d = FileDiscovery(tmp_path, poll_interval=POLL)
    yield d
    await d.close()


@pytest.fixture
async def peer(tmp_path: Path) -> AsyncIterator[FileDiscovery]:
    d = FileDiscovery(tmp_path, poll_interval=POLL)
    yield d
    await d.close()


async def next_event(watch: Watch, timeout: float = 3.0) -> WatchEvent:
    async with asyncio.timeout(timeout):
        return await anext(aiter(watch))


async def test_put_get_get_prefix_delete(disc: FileDiscovery) -> None:
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


async def test_arbitrary_key_characters(disc: FileDiscovery, tmp_path: Path) -> None:
    keys = ["v1/instances/ns/c/e/1f", "..", ".", "a/../../etc", "sp ace%2F/ü/✓", "x" * 80, "~"]
    for i, key in enumerate(keys):
        await disc.put(key, bytes([i]) * 3)
    for i, key in enumerate(keys):
        assert await disc.get(key) == KeyValue(key, bytes([i]) * 3)
    assert sorted(kv.key for kv in await disc.get_prefix("")) == sorted(keys)
    assert [kv.key for kv in await disc.get_prefix("a/..")] == ["a/../../etc"]
    names = os.listdir(tmp_path / "kv")  # one flat file per key, none hidden
    assert len(names) == len(keys) and not any(n.startswith(".") for n in names)
    with pytest.raises(InvalidArgument):
        await disc.put("", b"x")
    with pytest.raises(InvalidArgument):
        await disc.put("k" * 300, b"x")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=12), st.text(max_size=12))
def test_key_encoding_preserves_prefixes(prefix: str, rest: str) -> None:
    key = prefix + rest
    if key:
        assert key_filename(key).startswith(key_filename(prefix)) if prefix else True
    if prefix and rest:
        other = rest + prefix  # usually not prefixed by `prefix`: the equivalence must hold
        assert other.startswith(prefix) == key_filename(other).startswith(key_filename(prefix))


async def test_revoke_deletes_lease_keys_and_lease_file(disc: FileDiscovery) -> None:
    lease = await disc.grant_lease(5.0)
    assert lease.is_alive() and lease.ttl == 5.0 and os.path.exists(lease.path)
    await disc.put("k/leased", b"1", lease)
    await disc.put("k/free", b"2")
    assert await disc.get("k/leased") == KeyValue("k/leased", b"1", lease.id)
    await lease.revoke()
    await lease.revoke()  # idempotent
    assert not lease.is_alive() and not os.path.exists(lease.path)
    assert await disc.get("k/leased") is None
    assert await disc.get("k/free") is not None
    with pytest.raises(InvalidArgument):
        await disc.put("k/again", b"x", lease)


async def test_watch_snapshot_then_ordered_events(disc: FileDiscovery) -> None:
    lease = await disc.grant_lease(5.0)
    await disc.put("w/a", b"1", lease)
    await disc.put("x/ignored", b"0")
    watch = await disc.watch_prefix("w/")
    assert watch.snapshot == [KeyValue("w/a", b"1", lease.id)]
    await disc.put("w/b", b"2")
    assert await next_event(watch) == WatchEvent(PUT, "w/b", b"2")
    await disc.put("x/other", b"0")  # outside the prefix
    await disc.put("w/a", b"3", lease)
    assert await next_event(watch) == WatchEvent(PUT, "w/a", b"3")
    await disc.delete("w/b")
    assert await next_event(watch) == WatchEvent(DELETE, "w/b")
    await lease.revoke()
    assert await next_event(watch) == WatchEvent(DELETE, "w/a")
    await asyncio.sleep(POLL * 5)
    assert watch._queue.empty()  # type: ignore[attr-defined]  # no stray events
    await watch.close()
    assert [e async for e in watch] == []


async def test_changes_between_polls_coalesce_to_latest(disc: FileDiscovery) -> None:
    watch = await disc.watch_prefix("c/")
    for i in range(20):
        await disc.put("c/k", str(i).encode())
    await disc.put("c/gone", b"x")
    await disc.delete("c/gone")
    seen: list[WatchEvent] = []
    while not seen or seen[-1].value != b"19":
        seen.append(await next_event(watch))
    assert all(e == WatchEvent(PUT, "c/k", e.value) for e in seen)
    assert [int(e.value) for e in seen] == sorted(int(e.value) for e in seen)


async def test_two_clients_see_each_other(disc: FileDiscovery, peer: FileDiscovery) -> None:
    lease_a = await disc.grant_lease(5.0)
    await disc.put("peers/a", b"A", lease_a)
    watch_a = await disc.watch_prefix("peers/")
    watch_b = await peer.watch_prefix("peers/")
    assert [kv.key for kv in watch_b.snapshot] == ["peers/a"]
    lease_b = await peer.grant_lease(5.0)
    await peer.put("peers/b", b"B", lease_b)
    assert await next_event(watch_a) == WatchEvent(PUT, "peers/b", b"B")
    assert await next_event(watch_b) == WatchEvent(PUT, "peers/b", b"B")
    assert await disc.get("peers/b") == KeyValue("peers/b", b"B", lease_b.id)
    await peer.close()  # the peer "exits": its lease file goes first, then its keys
    assert await next_event(watch_a) == WatchEvent(DELETE, "peers/b")
    assert [e async for e in watch_b] == []
    assert [kv.key for kv in await disc.get_prefix("peers/")] == ["peers/a"]
    with pytest.raises(CannotConnect):
        await peer.get("peers/a")


async def test_hung_lease_expires_after_ttl_and_is_collected(
    disc: FileDiscovery, peer: FileDiscovery, tmp_path: Path
) -> None:
    ttl = 0.6
    lease = await peer.grant_lease(ttl)
    await peer.put("hung/key", b"x", lease)
    watch = await disc.watch_prefix("hung/")
    await asyncio.sleep(ttl * 1.5)  # the keepalive holds it beyond the TTL
    assert await disc.get("hung/key") is not None
    lease.suspend_keepalive()
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await next_event(watch, timeout=ttl + 3.0) == WatchEvent(DELETE, "hung/key")
    assert loop.time() - start <= ttl + 1.0
    assert await disc.get("hung/key") is None
    # Garbage collected from disk by the scanning peer: the key file and the stale lease file.
    assert os.listdir(tmp_path / "kv") == [] and os.listdir(tmp_path / "leases") == []


async def test_owner_notices_a_lost_lease(disc: FileDiscovery) -> None:
    ttl = 0.3
    lease = await disc.grant_lease(ttl)
    await disc.put("lost/key", b"x", lease)
    os.unlink(lease.path)  # as a peer does when it judges the lease stale
    assert await disc.get("lost/key") is None
    async with asyncio.timeout(ttl + 2.0):
        while lease.is_alive():
            await asyncio.sleep(0.02)
    with pytest.raises(InvalidArgument):
        await disc.put("lost/other", b"x", lease)


async def test_key_under_brand_new_lease_is_not_collected(
    disc: FileDiscovery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    view = DirView(str(tmp_path))
    lease = await disc.grant_lease(5.0)
    await disc.put("new/key", b"x", lease)
    # The scanner listed the leases before this lease existed, then saw its key.
    monkeypatch.setattr(view, "_live_leases", lambda now_ns: set())
    assert list(view.scan()) == ["new/key"]
    assert await disc.get("new/key") is not None


async def test_same_size_rewrite_within_a_clock_tick_is_seen(
    disc: FileDiscovery, tmp_path: Path
) -> None:
    await disc.put("r/k", b"aaaa")
    assert [kv.value for kv in await disc.get_prefix("r/")] == [b"aaaa"]
    path = tmp_path / "kv" / key_filename("r/k")
    before = os.stat(path)
    with open(path, "r+b") as f:  # same inode, same size, same mtime: only the content differs
        data = f.read().replace(b'"YWFhYQ=="', b'"YmJiYg=="')
        f.seek(0)
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert [kv.value for kv in await disc.get_prefix("r/")] == [b"bbbb"]


async def test_foreign_files_and_stale_temp_files(disc: FileDiscovery, tmp_path: Path) -> None:
    (tmp_path / "kv" / "garbage").write_bytes(b"not json")
    (tmp_path / "leases" / "zz-not-hex").write_bytes(b"x")
    stale_tmp = tmp_path / "kv" / ".tmp-1-dead"
    stale_tmp.write_bytes(b"half")
    os.utime(stale_tmp, (1, 1))
    await disc.put("ok", b"1")
    assert [kv.key for kv in await disc.get_prefix("")] == ["ok"]
    assert not stale_tmp.exists()


async def test_closed_client_refuses_work(tmp_path: Path) -> None:
    d = FileDiscovery(tmp_path)
    await d.close()
    await d.close()
    with pytest.raises(CannotConnect):
        await d.put("k", b"v")
    with pytest.raises(ValueError):
        FileDiscovery(tmp_path, poll_interval=0)

"""FileDiscovery: what only the directory backend has (key encoding, files on disk, polling,
garbage collection, foreign files). The discovery contract itself runs against it in
``test_discovery_contract.py``, with the memory and etcd backends."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo.runtime.discovery.base import KeyValue, WatchEvent, WatchEventKind
from dynamo.runtime.discovery.file import FileDiscovery
from dynamo.runtime.discovery.file_view import DirView, key_filename
from dynamo.runtime.errors import CannotConnect, InvalidArgument
from tests.unit.runtime.discovery_kit import next_event

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


async def test_a_lease_is_a_file_until_revoked(disc: FileDiscovery) -> None:
    lease = await disc.grant_lease(5.0)
    assert os.path.exists(lease.path)
    await disc.put("k/leased", b"1", lease)
    await lease.revoke()
    assert not os.path.exists(lease.path)
    assert await disc.get("k/leased") is None


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


async def test_an_expired_lease_is_collected_from_disk(
    disc: FileDiscovery, peer: FileDiscovery, tmp_path: Path
) -> None:
    """(Its expiry itself is in the contract suite.) The scanning peer removes the files."""
    ttl = 0.6
    lease = await peer.grant_lease(ttl)
    await peer.put("hung/key", b"x", lease)
    watch = await disc.watch_prefix("hung/")
    lease.suspend_keepalive()
    assert await next_event(watch, timeout=ttl + 3.0) == WatchEvent(DELETE, "hung/key")
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

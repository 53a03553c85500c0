"""File discovery: the etcd-shaped store in a directory shared by the processes of one host.

A key whose lease file is missing or staler than the TTL is absent, and any process may delete it:
the keys of a dead process (even one killed by SIGKILL) vanish within the TTL. Watches poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import msgspec

from dynamo.runtime.discovery.base import KeyValue, Lease, WatchEvent, WatchEventKind
from dynamo.runtime.discovery.client import DiscoveryClient
from dynamo.runtime.discovery.file_view import (
    DirView,
    LeaseInfo,
    LiveEntry,
    atomic_write,
    key_filename,
    parse_kv,
    read_file,
    unlink,
)
from dynamo.runtime.discovery.watch import QueueWatch
from dynamo.runtime.errors import InvalidArgument
from dynamo.runtime.naming import new_instance_id

_log = logging.getLogger(__name__)


async def _cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task})


class FileLease:
    """A lease file whose mtime a background task refreshes every ``ttl / 3``.

    If a refresh finds the file gone (collected by a peer) or comes later than the TTL (the loop
    stalled), the lease is lost: ``is_alive()`` turns False and its keys are gone for everyone.
    """

    def __init__(self, view: DirView, lease_id: int, ttl: float) -> None:
        self._view = view
        self._id = lease_id
        self._ttl = ttl
        self.path = view.lease_path(lease_id)
        self.keys: set[str] = set()
        self._alive = True
        self._revoked = False
        self._refreshed = time.monotonic()
        self._task: asyncio.Task[None] | None = asyncio.create_task(
            self._keepalive(), name=f"file-lease-keepalive-{lease_id:x}"
        )

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl(self) -> float:
        return self._ttl

    def is_alive(self) -> bool:
        return self._alive

    def suspend_keepalive(self) -> None:
        """Simulate a hung owner: stop refreshing; peers treat the lease as dead after its TTL."""
        if self._task is not None:
            self._task.cancel()

    async def revoke(self) -> None:
        await _cancel_and_wait(self._task)
        self._task = None
        if self._revoked:
            return
        self._revoked = True
        self._alive = False
        unlink(self.path)  # first: from now on every key under the lease is absent for all
        for key in self.keys:
            path = os.path.join(self._view.kv_dir, key_filename(key))
            data = read_file(path)
            kv = parse_kv(data) if data is not None else None
            if kv is not None and kv.lease_id == self._id:
                unlink(path)
        self.keys.clear()

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self._ttl / 3)
            late = time.monotonic() - self._refreshed > self._ttl
            try:
                if not late:
                    os.utime(self.path)
            except FileNotFoundError:
                late = True
            if late:
                self._alive = False
                unlink(self.path)
                _log.warning("discovery lease %x lost: keepalive late or lease collected", self._id)
                return
            self._refreshed = time.monotonic()


class FileDiscovery(DiscoveryClient[FileLease]):
    """:class:`Discovery` over ``directory``, shared by the processes of one host.

    Watches poll the directory every ``poll_interval`` seconds (one scan per process, shared by
    all its watches; only changed files are read). Changes between two scans coalesce: a watcher
    sees the latest value of each key, deletes first, then puts in write order.
    """

    def __init__(self, directory: str | os.PathLike[str], *, poll_interval: float = 0.1) -> None:
        if poll_interval <= 0:
            raise ValueError("poll_interval must be positive")
        self.directory = os.fspath(directory)
        self._view = DirView(self.directory)
        self._poll_interval = poll_interval
        self._visible: dict[str, LiveEntry] = {}
        self._poll_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        super().__init__(f"file discovery {self.directory}")

    async def grant_lease(self, ttl: float) -> FileLease:
        self._check_open()
        if ttl <= 0:
            raise InvalidArgument(f"lease TTL must be positive, got {ttl}")
        lease_id = new_instance_id()
        info = msgspec.json.encode(LeaseInfo(pid=os.getpid(), ttl=ttl))
        atomic_write(self._view.lease_dir, f"{lease_id:x}", info)
        self._view.remember_ttl(lease_id, ttl)
        lease = FileLease(self._view, lease_id, ttl)
        self._leases.append(lease)
        return lease

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> None:
        self._check_open()
        name = key_filename(key)
        if lease is not None:
            if not isinstance(lease, FileLease) or lease not in self._leases:
                raise InvalidArgument("file discovery keys need a lease granted by this client")
            if not lease.is_alive():
                raise InvalidArgument(f"lease {lease.id:x} is not alive")
            lease.keys.add(key)
        record = KeyValue(key=key, value=value, lease_id=None if lease is None else lease.id)
        atomic_write(self._view.kv_dir, name, msgspec.json.encode(record))
        self._wake.set()

    async def get(self, key: str) -> KeyValue | None:
        self._check_open()
        return self._view.read_kv(key, time.time_ns())

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        self._check_open()
        live = self._view.scan()
        return [live[key].kv for key in sorted(live) if key.startswith(prefix)]

    async def delete(self, key: str) -> None:
        self._check_open()
        unlink(os.path.join(self._view.kv_dir, key_filename(key)))
        self._wake.set()

    async def watch_prefix(self, prefix: str) -> QueueWatch:
        self._check_open()
        self._poll_once()  # bring the shared view up to date (existing watches get the diff)
        snapshot = [self._visible[k].kv for k in sorted(self._visible) if k.startswith(prefix)]
        watch = QueueWatch(prefix, snapshot, self._forget_watch)
        self._watches.append(watch)
        if self._poll_task is None:
            self._poll_task = asyncio.create_task(self._poll_loop(), name="file-discovery-poll")
        return watch

    def _poll_once(self) -> None:
        live = self._view.scan()
        old, self._visible = self._visible, live
        if not self._watches:
            return
        events = [WatchEvent(kind=WatchEventKind.DELETE, key=k) for k in sorted(old.keys() - live)]
        changed = [e for k, e in live.items() if (o := old.get(k)) is None or o.kv != e.kv]
        changed.sort(key=lambda e: (e.mtime_ns, e.kv.key))
        events += [
            WatchEvent(kind=WatchEventKind.PUT, key=e.kv.key, value=e.kv.value) for e in changed
        ]
        for event in events:
            for watch in self._watches:
                if event.key.startswith(watch.prefix):
                    watch.push(event)

    async def _poll_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                self._poll_once()
            except OSError as exc:  # e.g. the directory was removed; keep serving what we have
                _log.warning("file discovery scan of %s failed: %s", self.directory, exc)

    async def close(self) -> None:
        """End this client's watches, then revoke its leases (their keys vanish at once)."""
        if self._closed:
            return
        self._closed = True
        await _cancel_and_wait(self._poll_task)
        self._poll_task = None
        await self._release()

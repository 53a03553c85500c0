"""In-process discovery: a shared :class:`MemoryStore` and per-"process" clients.

Several :class:`MemoryDiscovery` clients over one store behave like several processes over one
etcd (``dynamo serve --in-process``, integration tests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo.runtime.discovery.base import KeyValue, Lease, WatchEvent, WatchEventKind
from dynamo.runtime.discovery.client import DiscoveryClient
from dynamo.runtime.discovery.watch import QueueWatch
from dynamo.runtime.errors import InvalidArgument
from dynamo.runtime.naming import new_instance_id


async def _cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    # asyncio.wait never raises the task's CancelledError, yet our own cancellation propagates.
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task})


@dataclass(slots=True)
class _LeaseRecord:
    ttl: float
    deadline: float
    keys: set[str] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


class MemoryStore:
    """The shared state (keys, leases, watches) behind any number of :class:`MemoryDiscovery`.

    All methods are synchronous and run on the event loop thread; a mutation notifies matching
    watches before it returns, so watch events are totally ordered. Lease expiry is the store's
    job (as it is etcd's): a lease not kept alive for ``ttl`` seconds is revoked by a loop timer.
    """

    def __init__(self) -> None:
        self._kv: dict[str, KeyValue] = {}
        self._leases: dict[int, _LeaseRecord] = {}
        self._watches: list[QueueWatch] = []

    def grant(self, ttl: float) -> int:
        if ttl <= 0:
            raise InvalidArgument(f"lease TTL must be positive, got {ttl}")
        lease_id = new_instance_id()
        record = _LeaseRecord(ttl=ttl, deadline=time.monotonic() + ttl)
        self._leases[lease_id] = record
        record.timer = asyncio.get_running_loop().call_later(ttl, self._check_expiry, lease_id)
        return lease_id

    def keepalive(self, lease_id: int) -> bool:
        """Refresh the lease; False if it no longer exists (revoked or expired)."""
        record = self._leases.get(lease_id)
        if record is None:
            return False
        record.deadline = time.monotonic() + record.ttl
        return True

    def has_lease(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def revoke(self, lease_id: int) -> None:
        record = self._leases.pop(lease_id, None)
        if record is None:
            return
        if record.timer is not None:
            record.timer.cancel()
        for key in sorted(record.keys):
            self.delete(key)

    def _check_expiry(self, lease_id: int) -> None:
        record = self._leases.get(lease_id)
        if record is None:
            return
        remaining = record.deadline - time.monotonic()
        if remaining <= 0:
            self.revoke(lease_id)
        else:
            loop = asyncio.get_running_loop()
            record.timer = loop.call_later(remaining, self._check_expiry, lease_id)

    def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        if not key:
            raise InvalidArgument("discovery key must not be empty")
        if lease_id is not None:
            record = self._leases.get(lease_id)
            if record is None:
                raise InvalidArgument(f"lease {lease_id:x} is not alive")
            record.keys.add(key)
        old = self._kv.get(key)
        if old is not None and old.lease_id is not None and old.lease_id != lease_id:
            old_record = self._leases.get(old.lease_id)
            if old_record is not None:
                old_record.keys.discard(key)
        self._kv[key] = KeyValue(key=key, value=value, lease_id=lease_id)
        self._emit(WatchEvent(kind=WatchEventKind.PUT, key=key, value=value))

    def get(self, key: str) -> KeyValue | None:
        return self._kv.get(key)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return [kv for key, kv in sorted(self._kv.items()) if key.startswith(prefix)]

    def delete(self, key: str) -> bool:
        old = self._kv.pop(key, None)
        if old is None:
            return False
        if old.lease_id is not None and (record := self._leases.get(old.lease_id)) is not None:
            record.keys.discard(key)
        self._emit(WatchEvent(kind=WatchEventKind.DELETE, key=key))
        return True

    def watch(self, prefix: str, on_close: Callable[[QueueWatch], None]) -> QueueWatch:
        """Snapshot and registration happen atomically: no event is missed or duplicated."""

        def _closed(watch: QueueWatch) -> None:
            self._unwatch(watch)
            on_close(watch)

        watch = QueueWatch(prefix, self.get_prefix(prefix), _closed)
        self._watches.append(watch)
        return watch

    def _unwatch(self, watch: QueueWatch) -> None:
        if watch in self._watches:
            self._watches.remove(watch)

    def _emit(self, event: WatchEvent) -> None:
        for watch in self._watches:
            if event.key.startswith(watch.prefix):
                watch.push(event)


class MemoryLease:
    """A lease of a :class:`MemoryStore`, refreshed every ``ttl / 3`` by a background task."""

    def __init__(self, store: MemoryStore, ttl: float) -> None:
        self._store = store
        self._ttl = ttl
        self._id = store.grant(ttl)
        self._revoked = False
        self._task: asyncio.Task[None] | None = asyncio.create_task(
            self._keepalive(), name=f"memory-lease-keepalive-{self._id:x}"
        )

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl(self) -> float:
        return self._ttl

    def is_alive(self) -> bool:
        return not self._revoked and self._store.has_lease(self._id)

    def suspend_keepalive(self) -> None:
        """Simulate a hung owner: stop refreshing, so the store expires the lease after its TTL."""
        if self._task is not None:
            self._task.cancel()

    async def revoke(self) -> None:
        self._revoked = True
        await _cancel_and_wait(self._task)
        self._task = None
        self._store.revoke(self._id)

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self._ttl / 3)
            if not self._store.keepalive(self._id):
                return


class MemoryDiscovery(DiscoveryClient[MemoryLease]):
    """One client ("process") of a :class:`MemoryStore`; owns its leases and watches.

    ``MemoryDiscovery()`` makes a private store; pass a shared ``store`` to let several clients
    see each other. ``close()`` revokes this client's leases (deleting their keys) and ends its
    watches.
    """

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.store = store if store is not None else MemoryStore()
        super().__init__("memory discovery")

    async def grant_lease(self, ttl: float) -> MemoryLease:
        self._check_open()
        lease = MemoryLease(self.store, ttl)
        self._leases.append(lease)
        return lease

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> None:
        self._check_open()
        self.store.put(key, value, None if lease is None else lease.id)

    async def get(self, key: str) -> KeyValue | None:
        self._check_open()
        return self.store.get(key)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        self._check_open()
        return self.store.get_prefix(prefix)

    async def delete(self, key: str) -> None:
        self._check_open()
        self.store.delete(key)

    async def watch_prefix(self, prefix: str) -> QueueWatch:
        self._check_open()
        watch = self.store.watch(prefix, self._forget_watch)
        self._watches.append(watch)
        return watch

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._release()

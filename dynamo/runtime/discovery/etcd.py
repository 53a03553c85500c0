"""Discovery on etcd (the many-machines shape), through its v3 JSON gateway.

* Leases are etcd leases (TTL rounded up to whole seconds; etcd may raise it to its minimum),
  kept alive every ``ttl / 3`` by a background task. A lease whose keepalive is refused (etcd
  expired it) or fails past the TTL is *lost*: ``is_alive()`` turns False and the runtime's lease
  watch shuts the process down, so it never serves unregistered.
* A prefix watch reads the snapshot and its revision, then streams changes from the next
  revision. When the stream breaks (etcd restarted, a connection dropped) it reconnects with
  backoff and resumes from the revision after the last event it delivered, so no event is missed
  or delivered twice. If etcd compacted that history away, it reads a new snapshot and emits the
  difference from what it had delivered.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from dynamo.runtime.discovery.base import KeyValue, Lease, WatchEvent, WatchEventKind
from dynamo.runtime.discovery.client import DiscoveryClient
from dynamo.runtime.discovery.etcd_gateway import EtcdError, EtcdGateway, EtcdKv
from dynamo.runtime.discovery.watch import QueueWatch
from dynamo.runtime.errors import CannotConnect, InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_ETCD_ENDPOINT = "http://127.0.0.1:2379"
_RETRY_MIN, _RETRY_MAX = 0.05, 1.0


def _key_value(kv: EtcdKv) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.lease or None)


async def _cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task})


class EtcdLease:
    """An etcd lease refreshed in the background until revoked, or lost."""

    def __init__(self, gateway: EtcdGateway, lease_id: int, ttl: int) -> None:
        self._gateway = gateway
        self._id = lease_id
        self._ttl = ttl
        self._deadline = time.monotonic() + ttl
        self._lost = False
        self._revoked = False
        self._task: asyncio.Task[None] | None = asyncio.create_task(
            self._keepalive(), name=f"etcd-lease-keepalive-{lease_id:x}"
        )

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl(self) -> float:
        return float(self._ttl)

    def is_alive(self) -> bool:
        return not (self._revoked or self._lost) and time.monotonic() < self._deadline

    def suspend_keepalive(self) -> None:
        """Simulate a hung owner: stop refreshing, so etcd expires the lease after its TTL."""
        if self._task is not None:
            self._task.cancel()

    async def revoke(self) -> None:
        if self._revoked:
            return
        self._revoked = True
        await _cancel_and_wait(self._task)
        self._task = None
        try:
            await self._gateway.revoke(self._id)
        except CannotConnect:
            log.warning("etcd unreachable: lease %x left to expire in %ds", self._id, self._ttl)

    async def _keepalive(self) -> None:
        interval = self._ttl / 3
        while time.monotonic() < self._deadline:
            await asyncio.sleep(min(interval, max(0.0, self._deadline - time.monotonic())))
            try:
                remaining = await self._gateway.keepalive(self._id)
            except (CannotConnect, EtcdError) as exc:
                log.warning("etcd lease %x keepalive failed: %s", self._id, exc)
                interval = max(_RETRY_MIN, self._ttl / 10)  # retry faster while failing
                continue
            if remaining <= 0:
                break
            self._deadline = time.monotonic() + remaining
            interval = self._ttl / 3
        self._lost = True
        log.error("etcd lease %x lost", self._id)


class EtcdWatch(QueueWatch):
    """A prefix watch fed by a task that follows etcd's watch stream across reconnects."""

    def __init__(
        self,
        gateway: EtcdGateway,
        prefix: str,
        snapshot: list[EtcdKv],
        revision: int,
        on_close: QueueWatch.OnClose,
    ) -> None:
        super().__init__(prefix, [_key_value(kv) for kv in snapshot], self._closed)
        self._gateway = gateway
        self._owner_on_close = on_close
        self._known = {kv.key: kv.value for kv in snapshot}
        self._revision = revision  # every change up to here has been delivered
        self._task: asyncio.Task[None] | None = asyncio.create_task(
            self._follow(), name=f"etcd-watch-{prefix}"
        )

    def _closed(self, watch: QueueWatch) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._owner_on_close(watch)

    async def _follow(self) -> None:
        prefix = self.prefix.encode()
        backoff = _RETRY_MIN
        while True:
            try:
                async for batch in self._gateway.watch(prefix, self._revision + 1):
                    backoff = _RETRY_MIN
                    if batch.compacted:
                        await self._resync(prefix)
                        break
                    # Every event of one revision (a transaction, a lease's keys expiring)
                    # comes in one batch: skip only revisions delivered before this batch.
                    floor = self._revision
                    for event in batch.events:
                        if event.kv.mod_revision > floor:
                            self._deliver(event.deleted, event.kv)
            except CannotConnect as exc:
                log.info("etcd watch on %r interrupted (%s); resuming", self.prefix, exc)
            await asyncio.sleep(backoff)
            backoff = min(_RETRY_MAX, backoff * 2)

    def _deliver(self, deleted: bool, kv: EtcdKv) -> None:
        self._revision = max(self._revision, kv.mod_revision)
        if deleted:
            if self._known.pop(kv.key, None) is not None:
                self.push(WatchEvent(WatchEventKind.DELETE, kv.key.decode()))
        else:
            self._known[kv.key] = kv.value
            self.push(WatchEvent(WatchEventKind.PUT, kv.key.decode(), kv.value))

    async def _resync(self, prefix: bytes) -> None:
        """History was compacted: emit the difference between what we delivered and now."""
        kvs, revision = await self._gateway.range_prefix(prefix)
        now = {kv.key: kv.value for kv in kvs}
        for key in sorted(set(self._known) - set(now)):
            self.push(WatchEvent(WatchEventKind.DELETE, key.decode()))
        for key, value in sorted(now.items()):
            if self._known.get(key) != value:
                self.push(WatchEvent(WatchEventKind.PUT, key.decode(), value))
        self._known = now
        self._revision = revision


class EtcdDiscovery(DiscoveryClient[EtcdLease]):
    """:class:`~dynamo.runtime.discovery.base.Discovery` on an etcd cluster.

    ``close()`` revokes this client's leases (deleting their keys) and ends its watches.
    """

    def __init__(self, endpoints: list[str] | None = None, *, timeout: float = 5.0) -> None:
        self.endpoints = endpoints or [DEFAULT_ETCD_ENDPOINT]
        self._gateway = EtcdGateway(self.endpoints, timeout=timeout)
        super().__init__("etcd discovery")

    async def grant_lease(self, ttl: float) -> EtcdLease:
        self._check_open()
        if ttl <= 0:
            raise InvalidArgument(f"lease TTL must be positive, got {ttl}")
        lease_id, granted = await self._gateway.grant(max(1, math.ceil(ttl)))
        lease = EtcdLease(self._gateway, lease_id, granted)
        self._leases.append(lease)
        return lease

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> None:
        self._check_open()
        if not key:
            raise InvalidArgument("discovery key must not be empty")
        lease_id = 0
        if lease is not None:
            lease_id = lease.id
            if not lease.is_alive():
                raise InvalidArgument(f"lease {lease_id:x} is not alive")
        try:
            await self._gateway.put(key.encode(), value, lease_id)
        except EtcdError as exc:
            raise InvalidArgument(f"etcd refused put of {key!r}: {exc}") from exc

    async def get(self, key: str) -> KeyValue | None:
        self._check_open()
        kv = await self._gateway.get(key.encode())
        return _key_value(kv) if kv is not None else None

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        self._check_open()
        kvs, _ = await self._gateway.range_prefix(prefix.encode())
        return [_key_value(kv) for kv in kvs]

    async def delete(self, key: str) -> None:
        self._check_open()
        await self._gateway.delete(key.encode())

    async def watch_prefix(self, prefix: str) -> EtcdWatch:
        self._check_open()
        kvs, revision = await self._gateway.range_prefix(prefix.encode())
        watch = EtcdWatch(self._gateway, prefix, kvs, revision, self._forget_watch)
        self._watches.append(watch)
        return watch

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._release()
        await self._gateway.close()

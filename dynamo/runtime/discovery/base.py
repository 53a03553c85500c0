"""The discovery contract, shaped exactly like etcd's.

* A **lease** has a TTL and is kept alive in the background by the backend until revoked. Keys put
  under a lease disappear when the lease is revoked or expires (its owner died, even by SIGKILL).
* ``get_prefix`` reads every live key under a prefix.
* ``watch_prefix`` returns a :class:`Watch`: first the snapshot (``Watch.snapshot``), then an async
  iterator of PUT/DELETE events that happened after the snapshot, in order.

Backends: ``memory`` (one process), ``file`` (a directory shared by the processes of one host),
``etcd`` (many hosts). Callers only see this interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Protocol

import msgspec


class KeyValue(msgspec.Struct, frozen=True):
    key: str
    value: bytes
    lease_id: int | None = None


class WatchEventKind(StrEnum):
    PUT = "put"
    DELETE = "delete"


class WatchEvent(msgspec.Struct, frozen=True):
    kind: WatchEventKind
    key: str
    value: bytes = b""


class Lease(Protocol):
    """A lease owned by this process. ``id`` is unique across the cluster."""

    @property
    def id(self) -> int: ...

    @property
    def ttl(self) -> float: ...

    async def revoke(self) -> None:
        """Stop the keepalive and delete every key under the lease (idempotent)."""
        ...

    def is_alive(self) -> bool:
        """False once revoked or lost (keepalive failed past the TTL)."""
        ...


class Watch(Protocol):
    """A prefix watch: the snapshot, then the changes after it. Close it when done."""

    @property
    def snapshot(self) -> list[KeyValue]: ...

    def __aiter__(self) -> AsyncIterator[WatchEvent]: ...

    async def close(self) -> None: ...


class Discovery(Protocol):
    async def grant_lease(self, ttl: float) -> Lease:
        """Create a lease kept alive in the background until revoked or this backend closes."""
        ...

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> None: ...

    async def get(self, key: str) -> KeyValue | None: ...

    async def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    async def delete(self, key: str) -> None: ...

    async def watch_prefix(self, prefix: str) -> Watch: ...

    async def close(self) -> None:
        """Revoke this process's leases and release resources (idempotent)."""
        ...

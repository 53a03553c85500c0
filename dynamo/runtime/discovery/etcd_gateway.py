"""A small async client of etcd's v3 JSON gateway (grpc-gateway, part of every etcd server).

Why the gateway over httpx rather than a gRPC client: PyPI has no well-kept *async* etcd v3
client (``etcd3`` is sync and unmaintained, ``aetcd`` is stale), while the gateway is served by
etcd itself on the client port, speaks the same v3 API (KV, lease, watch), and needs nothing
beyond httpx, already a dependency. Keys and values travel base64-encoded; int64 fields come
back as JSON strings.

Every call raises :class:`~dynamo.runtime.errors.CannotConnect` when no endpoint answers, and
tries the configured endpoints in turn (the first that answers is kept).
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from dynamo.runtime.errors import CannotConnect


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range_end(prefix: bytes) -> bytes:
    """etcd's range end for "every key starting with ``prefix``" (``b"\\0"``: all keys)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(frozen=True, slots=True)
class EtcdKv:
    key: bytes
    value: bytes
    lease: int
    mod_revision: int


@dataclass(frozen=True, slots=True)
class EtcdEvent:
    deleted: bool
    kv: EtcdKv


@dataclass(slots=True)
class WatchBatch:
    """One message of a watch stream: events (possibly none) and the header revision."""

    revision: int
    events: list[EtcdEvent] = field(default_factory=list)
    compacted: bool = False


def _kv(raw: dict[str, Any]) -> EtcdKv:
    return EtcdKv(
        key=unb64(raw.get("key")),
        value=unb64(raw.get("value")),
        lease=int(raw.get("lease", 0)),
        mod_revision=int(raw.get("mod_revision", 0)),
    )


class EtcdGateway:
    """The v3 calls dynamo needs, over one pooled ``httpx.AsyncClient``."""

    def __init__(self, endpoints: list[str], *, timeout: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self._endpoints = [e.rstrip("/") for e in endpoints]
        self._current = 0
        self._client = httpx.AsyncClient(timeout=timeout)
        # Watches are long-lived streams that stay silent while nothing changes.
        self._stream_timeout = httpx.Timeout(timeout, read=None)

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        for attempt in range(len(self._endpoints)):
            index = (self._current + attempt) % len(self._endpoints)
            try:
                response = await self._client.post(self._endpoints[index] + path, json=body)
            except httpx.HTTPError as exc:
                last = exc
                continue
            self._current = index
            payload: dict[str, Any] = response.json()
            if response.status_code != 200:
                raise EtcdError(payload.get("message") or payload.get("error") or str(payload))
            return payload
        raise CannotConnect(f"etcd unreachable at {', '.join(self._endpoints)}: {last}")

    async def range_prefix(self, prefix: bytes) -> tuple[list[EtcdKv], int]:
        """Every key under ``prefix`` (sorted) and the store revision they were read at."""
        body = {"key": b64(prefix or b"\0"), "range_end": b64(prefix_range_end(prefix))}
        payload = await self._call("/v3/kv/range", body)
        revision = int(payload["header"]["revision"])
        return [_kv(raw) for raw in payload.get("kvs", [])], revision

    async def get(self, key: bytes) -> EtcdKv | None:
        payload = await self._call("/v3/kv/range", {"key": b64(key)})
        kvs = payload.get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        await self._call("/v3/kv/put", {"key": b64(key), "value": b64(value), "lease": lease})

    async def delete(self, key: bytes) -> None:
        await self._call("/v3/kv/deleterange", {"key": b64(key)})

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (id, granted TTL in seconds; etcd may raise a too-small TTL)."""
        payload = await self._call("/v3/lease/grant", {"TTL": ttl, "ID": 0})
        if payload.get("error"):
            raise EtcdError(str(payload["error"]))
        return int(payload["ID"]), int(payload["TTL"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its remaining TTL, 0 if it no longer exists."""
        payload = await self._call("/v3/lease/keepalive", {"ID": lease})
        result = payload.get("result", {})
        return int(result.get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("/v3/lease/revoke", {"ID": lease})
        except EtcdError:
            pass  # already gone (expired or revoked): the goal is reached

    async def watch(self, prefix: bytes, start_revision: int) -> AsyncIterator[WatchBatch]:
        """Stream the changes under ``prefix`` from ``start_revision`` on.

        Ends (raises CannotConnect) when the connection breaks; the caller resumes from the
        revision after the last one it saw. A ``compacted`` batch means the history needed is
        gone: the caller must read a fresh snapshot.
        """
        body = {
            "create_request": {
                "key": b64(prefix or b"\0"),
                "range_end": b64(prefix_range_end(prefix)),
                "start_revision": start_revision,
            }
        }
        url = self._endpoints[self._current] + "/v3/watch"
        try:
            async with self._client.stream(
                "POST", url, json=body, timeout=self._stream_timeout
            ) as response:
                if response.status_code != 200:
                    raise CannotConnect(f"etcd watch refused: HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    batch = _watch_batch(json.loads(line))
                    if batch is not None:
                        yield batch
        except httpx.HTTPError as exc:
            self._current = (self._current + 1) % len(self._endpoints)
            raise CannotConnect(f"etcd watch stream lost: {exc}") from exc
        raise CannotConnect("etcd watch stream ended")


def _watch_batch(message: dict[str, Any]) -> WatchBatch | None:
    result = message.get("result")
    if result is None:
        raise CannotConnect(f"etcd watch error: {message.get('error', message)}")
    revision = int(result.get("header", {}).get("revision", 0))
    if int(result.get("compact_revision", 0)) > 0:
        return WatchBatch(revision, compacted=True)
    events = [
        EtcdEvent(deleted=raw.get("type") == "DELETE", kv=_kv(raw["kv"]))
        for raw in result.get("events", [])
    ]
    return WatchBatch(revision, events)


class EtcdError(Exception):
    """etcd answered but refused the call (e.g. a lease that no longer exists)."""

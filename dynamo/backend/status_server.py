"""A worker's system status server (FACTS §8): ``/health``, ``/live`` and ``/metrics``.

Enabled by ``DYN_SYSTEM_PORT`` (``--system-port``; 0 picks a free port, unset disables it).
``/health`` and ``/live`` (renamed by ``DYN_SYSTEM_HEALTH_PATH`` / ``DYN_SYSTEM_LIVE_PATH``)
answer ``{"status": "ready"|"notready", "endpoints": {...}, "uptime": {"secs", "nanos"}}`` with
200 when ready and 503 otherwise. Before its endpoints are served the worker reports
``DYN_SYSTEM_STARTING_HEALTH_STATUS`` (default ``notready``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import msgspec
from prometheus_client import CollectorRegistry, generate_latest

from dynamo.observability.metrics import WorkerMetrics
from dynamo.runtime.http_limits import HttpLimits
from dynamo.runtime.http_server import HttpServer

_encoder = msgspec.json.Encoder()
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"


def starting_ready() -> bool:
    """Whether ``DYN_SYSTEM_STARTING_HEALTH_STATUS`` says a starting worker counts as ready."""
    value = os.environ.get("DYN_SYSTEM_STARTING_HEALTH_STATUS", "notready").strip().lower()
    if value not in ("ready", "notready"):
        raise ValueError(f"DYN_SYSTEM_STARTING_HEALTH_STATUS must be ready or notready: {value!r}")
    return value == "ready"


def _path(env: str, default: str) -> bytes:
    path = os.environ.get(env) or default
    return (path if path.startswith("/") else "/" + path).encode()


class StatusServer:
    """Serves the worker's health (``endpoints()`` -> name -> ready?) and metrics."""

    def __init__(
        self,
        endpoints: Callable[[], dict[str, bool]],
        registry: CollectorRegistry,
        metrics: WorkerMetrics | None,
        host: str,
        port: int,
    ) -> None:
        self._endpoints = endpoints
        self._registry = registry
        self._metrics = metrics
        self._started = time.monotonic()
        self._health_paths = (
            _path("DYN_SYSTEM_HEALTH_PATH", "/health"),
            _path("DYN_SYSTEM_LIVE_PATH", "/live"),
        )
        self._server = HttpServer(self, host, port, limits=HttpLimits.from_env())

    @property
    def port(self) -> int:
        return self._server.port

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop()

    def handle(
        self, method: bytes, path: bytes, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes] | tuple[int, bytes, bytes]:
        if method != b"GET":
            return 405, b'{"error":"method not allowed"}'
        if path in self._health_paths:
            endpoints = self._endpoints()
            ready = bool(endpoints) and all(endpoints.values())
            uptime = time.monotonic() - self._started
            payload = {
                "status": "ready" if ready else "notready",
                "endpoints": {k: "ready" if v else "notready" for k, v in endpoints.items()},
                "uptime": {"secs": int(uptime), "nanos": int((uptime % 1) * 1e9)},
            }
            return (200 if ready else 503), _encoder.encode(payload)
        if path == b"/metrics":
            if self._metrics is not None:
                self._metrics.uptime.set(time.monotonic() - self._started)
            return 200, generate_latest(self._registry), _PROMETHEUS
        return 404, b'{"error":"not found"}'

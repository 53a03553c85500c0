"""A worker's system status server (FACTS §8): ``/health``, ``/live`` and ``/metrics``.

Enabled by ``DYN_SYSTEM_PORT`` (``--system-port``; 0 picks a free port, unset disables it).
``/health`` and ``/live`` answer ``{"status": "ready"|"notready", "endpoints": {...},
"uptime": {"secs", "nanos"}}`` with 200 when ready and 503 otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from prometheus_client import CollectorRegistry, generate_latest

from dynamo.observability.metrics import WorkerMetrics
from dynamo.runtime.http_server import HttpServer

_encoder = msgspec.json.Encoder()
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"


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
        self._server = HttpServer(self, host, port)

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
        if path in (b"/health", b"/live"):
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

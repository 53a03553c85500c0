"""A worker's system status server (FACTS §8): ``/health``, ``/live`` and ``/metrics``.

Enabled by ``--system-port`` (``DYN_SYSTEM_PORT``; 0 picks a free port, unset disables it).
``/health`` and ``/live`` (renamed by ``--system-health-path`` / ``--system-live-path``)
answer ``{"status": "ready"|"notready", "endpoints": {...}, "uptime": {"secs", "nanos"}}`` with
200 when ready and 503 otherwise. Before its endpoints are served the worker reports
``--system-starting-health-status`` (default ``notready``). :class:`StatusConfig` holds these
settings; the flags' ``DYN_SYSTEM_*`` twins are read by the config layer (``add_flag``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry, generate_latest

from dynamo.observability.metrics import WorkerMetrics
from dynamo.runtime.config import add_flag
from dynamo.runtime.http_limits import HttpLimits
from dynamo.runtime.http_server import HttpServer

_encoder = msgspec.json.Encoder()
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"


STARTING_STATUSES = ("ready", "notready")


def _normalize(text: str) -> str:
    return text.strip().lower()


@dataclass(frozen=True, slots=True)
class StatusConfig:
    """The status server's paths and what a starting worker reports."""

    health_path: str = "/health"
    live_path: str = "/live"
    starting_health_status: str = "notready"

    def __post_init__(self) -> None:
        if self.starting_health_status not in STARTING_STATUSES:
            raise ValueError(
                "DYN_SYSTEM_STARTING_HEALTH_STATUS must be ready or notready: "
                f"{self.starting_health_status!r}"
            )

    @property
    def starting_ready(self) -> bool:
        """Whether a starting worker (endpoints not served yet) counts as ready."""
        return self.starting_health_status == "ready"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        d = StatusConfig()
        add_flag(
            parser,
            "--system-health-path",
            default=d.health_path,
            help="path of the status server's health route",
        )
        add_flag(
            parser,
            "--system-live-path",
            default=d.live_path,
            help="path of the status server's liveness route",
        )
        add_flag(
            parser,
            "--system-starting-health-status",
            default=d.starting_health_status,
            type=_normalize,
            help="health a starting worker reports (ready or notready)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StatusConfig:
        return cls(
            health_path=args.system_health_path,
            live_path=args.system_live_path,
            starting_health_status=args.system_starting_health_status,
        )


def _route(path: str, default: str) -> bytes:
    path = path or default
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
        config: StatusConfig | None = None,
    ) -> None:
        config = config or StatusConfig()
        self._endpoints = endpoints
        self._registry = registry
        self._metrics = metrics
        self._started = time.monotonic()
        self._health_paths = (
            _route(config.health_path, "/health"),
            _route(config.live_path, "/live"),
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

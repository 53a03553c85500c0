"""The worker status server's routes and starting status (FACTS §8 environment)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from dynamo.backend.status_server import StatusServer
from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub
from tests.fakes import CountingEngine

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")


def server(endpoints: dict[str, bool]) -> StatusServer:
    return StatusServer(lambda: endpoints, CollectorRegistry(), None, "127.0.0.1", 0)


def test_health_and_live_payloads() -> None:
    up = server({"generate": True})
    status, body = up.handle(b"GET", b"/health", b"", None, b"")[:2]
    payload = json.loads(body)
    assert status == 200 and payload["status"] == "ready"
    assert payload["endpoints"] == {"generate": "ready"} and set(payload["uptime"]) == {
        "secs",
        "nanos",
    }
    down = server({"generate": False})
    status, body = down.handle(b"GET", b"/live", b"", None, b"")[:2]
    assert status == 503 and json.loads(body)["status"] == "notready"
    assert server({}).handle(b"GET", b"/health", b"", None, b"")[0] == 503  # nothing served
    assert up.handle(b"POST", b"/health", b"", None, b"")[0] == 405
    assert up.handle(b"GET", b"/nope", b"", None, b"")[0] == 404


def test_paths_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_SYSTEM_HEALTH_PATH", "/ready-z")
    monkeypatch.setenv("DYN_SYSTEM_LIVE_PATH", "alive")  # a missing leading slash is added
    s = server({"generate": True})
    assert s.handle(b"GET", b"/ready-z", b"", None, b"")[0] == 200
    assert s.handle(b"GET", b"/alive", b"", None, b"")[0] == 200
    assert s.handle(b"GET", b"/health", b"", None, b"")[0] == 404


@pytest.mark.parametrize(("value", "ready"), [(None, False), ("notready", False), ("ready", True)])
def test_starting_status(monkeypatch: pytest.MonkeyPatch, value: str | None, ready: bool) -> None:
    if value is None:
        monkeypatch.delenv("DYN_SYSTEM_STARTING_HEALTH_STATUS", raising=False)
    else:
        monkeypatch.setenv("DYN_SYSTEM_STARTING_HEALTH_STATUS", value)
    config = WorkerConfig(runtime=RUNTIME, install_signal_handlers=False)
    worker = Worker([CountingEngine()], config, runtime=DistributedRuntime(RUNTIME, InProcessHub()))
    assert worker._health() == {"generate": ready}  # noqa: SLF001 - before start: starting
    worker.request_shutdown()
    assert worker._health() == {"generate": False}  # noqa: SLF001 - shutting down: never ready


def test_a_bad_starting_status_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_SYSTEM_STARTING_HEALTH_STATUS", "maybe")
    with pytest.raises(ValueError, match="DYN_SYSTEM_STARTING_HEALTH_STATUS"):
        Worker([CountingEngine()], WorkerConfig(runtime=RUNTIME))

"""The worker status server's routes and starting status (FACTS §8 environment)."""

from __future__ import annotations

import argparse
import json

import pytest
from prometheus_client import CollectorRegistry

from dynamo.backend.status_server import StatusConfig, StatusServer
from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub
from tests.fakes import CountingEngine

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")


def server(endpoints: dict[str, bool], config: StatusConfig | None = None) -> StatusServer:
    return StatusServer(lambda: endpoints, CollectorRegistry(), None, "127.0.0.1", 0, config)


def status_config(argv: list[str]) -> StatusConfig:
    parser = argparse.ArgumentParser()
    StatusConfig.add_arguments(parser)
    return StatusConfig.from_args(parser.parse_args(argv))


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


def test_paths_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_SYSTEM_HEALTH_PATH", raising=False)
    monkeypatch.delenv("DYN_SYSTEM_LIVE_PATH", raising=False)
    assert status_config([]) == StatusConfig()
    flags = status_config(["--system-health-path=/ready-z", "--system-live-path=alive"])
    monkeypatch.setenv("DYN_SYSTEM_HEALTH_PATH", "/ready-z")
    monkeypatch.setenv("DYN_SYSTEM_LIVE_PATH", "alive")  # a missing leading slash is added
    env = status_config([])
    assert flags == env == StatusConfig("/ready-z", "alive")
    s = server({"generate": True}, env)
    assert s.handle(b"GET", b"/ready-z", b"", None, b"")[0] == 200
    assert s.handle(b"GET", b"/alive", b"", None, b"")[0] == 200
    assert s.handle(b"GET", b"/health", b"", None, b"")[0] == 404


@pytest.mark.parametrize(
    ("value", "ready"), [(None, False), ("notready", False), ("ready", True), (" Ready", True)]
)
def test_starting_status(monkeypatch: pytest.MonkeyPatch, value: str | None, ready: bool) -> None:
    monkeypatch.delenv("DYN_SYSTEM_STARTING_HEALTH_STATUS", raising=False)
    from_flag = status_config([] if value is None else [f"--system-starting-health-status={value}"])
    if value is not None:
        monkeypatch.setenv("DYN_SYSTEM_STARTING_HEALTH_STATUS", value)
    status = status_config([])
    assert status == from_flag and status.starting_ready is ready
    config = WorkerConfig(runtime=RUNTIME, install_signal_handlers=False, status=status)
    worker = Worker([CountingEngine()], config, runtime=DistributedRuntime(RUNTIME, InProcessHub()))
    assert worker._health() == {"generate": ready}  # noqa: SLF001 - before start: starting
    worker.request_shutdown()
    assert worker._health() == {"generate": False}  # noqa: SLF001 - shutting down: never ready


def test_a_bad_starting_status_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_SYSTEM_STARTING_HEALTH_STATUS", "maybe")
    with pytest.raises(ValueError, match="DYN_SYSTEM_STARTING_HEALTH_STATUS"):
        status_config([])
    with pytest.raises(ValueError, match="ready or notready"):
        StatusConfig(starting_health_status="maybe")

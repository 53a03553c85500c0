"""Every engine becomes a worker the same way: serve_engine's wiring with a test engine."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import msgspec
import pytest

from dynamo.backend.engine import EngineConfig
from dynamo.backend.health_check import HealthCheckConfig
from dynamo.backend.kv_publisher import KVPublisher
from dynamo.backend.serve_engine import (
    ServeOptions,
    WorkerSpec,
    add_worker_arguments,
    build_served_worker,
    serve_engine,
)
from dynamo.backend.status_server import StatusConfig
from dynamo.protocol.model_card import ModelCard, WorkerRole
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.naming import model_cards_prefix
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub
from tests.fakes import CountingEngine

pytestmark = pytest.mark.unit

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")


async def test_engines_are_built_with_the_publisher_and_registered_with_their_role() -> None:
    hub = InProcessHub()
    publishers: list[KVPublisher] = []

    def factory(publisher: KVPublisher) -> CountingEngine:
        publishers.append(publisher)
        return CountingEngine()

    spec = WorkerSpec(model_path="", role=WorkerRole.PREFILL, num_engines=2)
    worker = build_served_worker(factory, spec, RUNTIME, hub=hub, install_signal_handlers=False)
    assert len(publishers) == 2 and publishers[0] is publishers[1], "one publisher per worker"
    task = asyncio.create_task(worker.run())
    observer = DistributedRuntime(RUNTIME, hub)
    await observer.start()
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        kvs = await observer.discovery.get_prefix(model_cards_prefix("dynamo"))
        cards = [msgspec.json.decode(kv.value, type=ModelCard) for kv in kvs]
        assert sorted(c.instance_id for c in cards) == sorted(worker.worker_ids)
        assert {(c.role, c.component) for c in cards} == {(WorkerRole.PREFILL, "prefill")}
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(task, 10)
        await observer.shutdown()


class SilentEngine(CountingEngine):
    """An engine that publishes no KV events (as vLLM's ``--no-kv-events``)."""

    async def start(self, worker_id: int) -> EngineConfig:
        return dataclasses.replace(await super().start(worker_id), kv_events=False)


async def test_an_engine_without_kv_events_says_so_in_its_card() -> None:
    hub = InProcessHub()
    engines: list[CountingEngine] = [SilentEngine(), CountingEngine()]
    spec = WorkerSpec(model_path="", num_engines=2)
    worker = build_served_worker(
        lambda publisher: engines.pop(0), spec, RUNTIME, hub=hub, install_signal_handlers=False
    )
    task = asyncio.create_task(worker.run())
    observer = DistributedRuntime(RUNTIME, hub)
    await observer.start()
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        kvs = await observer.discovery.get_prefix(model_cards_prefix("dynamo"))
        cards = {
            c.instance_id: c for c in (msgspec.json.decode(kv.value, type=ModelCard) for kv in kvs)
        }
        assert [cards[w].kv_events for w in worker.worker_ids] == [False, True]
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(task, 10)
        await observer.shutdown()


def test_an_endpoint_outside_the_namespace_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    args = parser.parse_args(["--namespace", "ns", "--discovery-backend", "memory"])
    spec = WorkerSpec(model_path="", endpoint="dyn://other.backend.generate")
    assert serve_engine(lambda p: CountingEngine(), spec, args, name="test engine") == 2
    assert "test engine: --endpoint must be in the runtime's --namespace" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["flags", "env"])
def test_worker_settings_reach_the_worker(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    envs = {
        "DYN_STRICT_STREAM_VALIDATION": "1",
        "DYN_SYSTEM_HEALTH_PATH": "/hz",
        "DYN_SYSTEM_LIVE_PATH": "/lz",
        "DYN_SYSTEM_STARTING_HEALTH_STATUS": "ready",
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "DYN_CANARY_WAIT_TIME": "2",
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5",
        "DYN_HEALTH_CHECK_PAYLOAD": '{"token_ids": [1]}',
    }
    for name, value in envs.items():
        if source == "env":
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    argv = ["--discovery-backend", "memory", "--request-plane", "local", "--event-plane", "local"]
    if source == "flags":
        argv += ["--strict-stream-validation", "--system-health-path=/hz"]
        argv += ["--system-live-path=/lz", "--system-starting-health-status=ready"]
        argv += ["--health-check-enabled", "--canary-wait-time=2"]
        argv += ["--health-check-request-timeout=0.5", '--health-check-payload={"token_ids": [1]}']
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    options = ServeOptions.from_args(args)
    worker = build_served_worker(
        lambda _: CountingEngine(),
        WorkerSpec(model_path=""),
        RuntimeConfig.from_args(args),
        options,
        hub=InProcessHub(),
        install_signal_handlers=False,
    )
    config = worker.config
    assert config.strict_validation is True
    assert all(r.adapter.strict for r in worker._regs)  # noqa: SLF001 - the adapters built
    assert config.status == StatusConfig("/hz", "/lz", "ready")
    assert worker._health() == {"generate": True}  # noqa: SLF001 - starting counts as ready
    assert config.health_check == HealthCheckConfig(True, 2.0, 0.5, '{"token_ids": [1]}')

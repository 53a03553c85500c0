"""Every engine becomes a worker the same way: serve_engine's wiring with a test engine."""

from __future__ import annotations

import argparse
import asyncio

import msgspec
import pytest

from dynamo.backend.kv_publisher import KVPublisher
from dynamo.backend.serve_engine import (
    WorkerSpec,
    add_worker_arguments,
    build_served_worker,
    serve_engine,
)
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


def test_an_endpoint_outside_the_namespace_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    args = parser.parse_args(["--namespace", "ns", "--discovery-backend", "memory"])
    spec = WorkerSpec(model_path="", endpoint="dyn://other.backend.generate")
    assert serve_engine(lambda p: CountingEngine(), spec, args, name="test engine") == 2
    assert "test engine: --endpoint must be in the runtime's --namespace" in capsys.readouterr().err

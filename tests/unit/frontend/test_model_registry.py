"""The model registry follows model cards: appear, refuse a mismatched tokenizer, retire."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec
import pytest

from dynamo.frontend.model_registry import ModelRegistry
from dynamo.protocol.model_card import ModelCard
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.errors import ModelNotFound, NoInstances
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime

EP = EndpointId("dynamo", "backend", "generate")


def card(instance_id: int, checksum: str = "sha256:a", name: str = "m") -> ModelCard:
    return ModelCard(
        served_model_name=name,
        model_path="/nowhere",
        namespace="dynamo",
        component="backend",
        endpoint="generate",
        instance_id=instance_id,
        context_length=100,
        kv_block_size=16,
        tokenizer_checksum=checksum,
    )


@pytest.fixture
async def runtime() -> AsyncIterator[DistributedRuntime]:
    rt = DistributedRuntime(
        RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")
    )
    await rt.start()
    yield rt
    await rt.shutdown()


async def wait_until(predicate: object) -> None:
    async with asyncio.timeout(5):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def test_models_appear_refuse_mismatch_and_retire(
    runtime: DistributedRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    built: list[str] = []

    async def factory(c: ModelCard) -> str:
        built.append(c.served_model_name)
        return f"pipeline-{c.served_model_name}"

    registry: ModelRegistry[str] = ModelRegistry(runtime, factory, retention_s=30)
    await registry.start()
    try:
        with pytest.raises(ModelNotFound):
            registry.get("m")
        put = runtime.discovery.put
        await put(EP.model_card_key(1), msgspec.json.encode(card(1)), runtime.lease)
        await wait_until(lambda: [e.name for e in registry.models()] == ["m"])
        assert registry.get("m").pipeline == "pipeline-m"
        await put(EP.model_card_key(2), msgspec.json.encode(card(2)), runtime.lease)
        with caplog.at_level(logging.ERROR):
            await put(EP.model_card_key(3), msgspec.json.encode(card(3, "sha256:b")), runtime.lease)
            await wait_until(lambda: 2 in registry.get("m").cards)
            await wait_until(lambda: "differs from the model's pipeline" in caplog.text)
        assert sorted(registry.get("m").cards) == [1, 2]
        assert built == ["m"], "one pipeline per model"
        await runtime.discovery.delete(EP.model_card_key(1))
        await runtime.discovery.delete(EP.model_card_key(2))
        await wait_until(lambda: not registry.models())
        with pytest.raises(NoInstances, match="temporarily unavailable"):
            registry.get("m")
    finally:
        await registry.close()

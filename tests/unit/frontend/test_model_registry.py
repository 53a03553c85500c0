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
from tests.fakes import make_card

EP = EndpointId("dynamo", "backend", "generate")


def card(instance_id: int, checksum: str = "sha256:a", name: str = "m") -> ModelCard:
    return make_card(
        instance_id,
        served_model_name=name,
        model_path="/nowhere",
        context_length=100,
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


async def test_routers_follow_discovery_and_close_when_the_model_retires(
    runtime: DistributedRuntime,
) -> None:
    from tests.unit.frontend.handler_kit import CountingRouter

    made: list[CountingRouter] = []

    async def router_factory(c: ModelCard) -> CountingRouter:
        made.append(CountingRouter())
        return made[-1]

    async def factory(c: ModelCard) -> str:
        return "pipeline"

    registry: ModelRegistry[str] = ModelRegistry(
        runtime, factory, router_factory=router_factory, retention_s=30
    )
    await registry.start()
    put, delete = runtime.discovery.put, runtime.discovery.delete
    try:
        for round_ in range(3):  # the model's workers leave and come back, three times
            ids = [10 * round_ + 1, 10 * round_ + 2]
            for i in ids:
                await put(EP.model_card_key(i), msgspec.json.encode(card(i)), runtime.lease)
            await wait_until(lambda: made and made[-1].workers == set(ids))  # noqa: B023
            assert len(registry.live_routers()) == 1
            await delete(EP.model_card_key(ids[0]))
            await wait_until(lambda: made[-1].workers == {ids[1]})  # noqa: B023
            await delete(EP.model_card_key(ids[1]))
            await wait_until(lambda: not registry.live_routers())
            assert made[-1].closed
        await put(EP.model_card_key(99), msgspec.json.encode(card(99)), runtime.lease)
        await wait_until(lambda: len(made) == 4 and made[-1].workers == {99})
        assert registry.live_routers() == [made[-1]]
        assert [r.closed for r in made] == [True, True, True, False]
    finally:
        await registry.close()
    assert made[-1].closed


async def test_a_prefill_card_never_defines_the_decode_pipeline(
    runtime: DistributedRuntime,
) -> None:
    from dynamo.protocol.model_card import WorkerRole

    built: list[WorkerRole] = []

    async def factory(c: ModelCard) -> str:
        built.append(c.role)
        return f"pipeline-from-{c.role.value}"

    registry: ModelRegistry[str] = ModelRegistry(runtime, factory)
    await registry.start()
    put = runtime.discovery.put
    try:
        prefill = msgspec.structs.replace(card(1), role=WorkerRole.PREFILL, component="prefill")
        await put(EP.model_card_key(1), msgspec.json.encode(prefill), runtime.lease)

        def refused_for_want_of_a_decode_worker() -> bool:
            try:
                registry.get("m")
            except NoInstances as exc:
                return "no decode worker" in str(exc)
            except ModelNotFound:  # the card not seen yet (the watch is another task)
                return False
            return False

        await wait_until(refused_for_want_of_a_decode_worker)
        with pytest.raises(NoInstances, match="no decode worker"):
            registry.get("m")
        assert registry.models() == [] and built == []
        decode = msgspec.structs.replace(card(2), role=WorkerRole.DECODE)
        await put(EP.model_card_key(2), msgspec.json.encode(decode), runtime.lease)
        await wait_until(lambda: registry.models())
        entry = registry.get("m")
        assert entry.pipeline == "pipeline-from-decode" and built == [WorkerRole.DECODE]
        assert set(entry.routers) == {WorkerRole.PREFILL, WorkerRole.DECODE}
    finally:
        await registry.close()

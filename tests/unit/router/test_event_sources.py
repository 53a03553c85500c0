"""Workers the KV router expects KV events from but that cannot provide them
(``router_kv_event_source_mismatch_workers``, issue 17): the pure evaluation, and a real KV
router on an in-process runtime whose gauge follows a worker without ``kv_recovery`` (or with
its KV events disabled) joining and leaving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from dynamo.backend.kv_publisher import KVPublisher
from dynamo.observability.router_metrics import RouterRequestMetrics
from dynamo.protocol.model_card import ModelCard
from dynamo.router.config import KVRouterSettings
from dynamo.router.event_sources import EventSourceMonitor
from dynamo.router.kv_router import KVRouter
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub
from tests.fakes import make_card

ENDPOINT = EndpointId("sources", "backend", "generate")
GAUGE = "dynamo_component_router_kv_event_source_mismatch_workers"
LABELS = {
    "dynamo_namespace": "sources",
    "dynamo_component": "backend",
    "dynamo_endpoint": "generate",
    "router_id": "9",
    "model": "demo",
    "worker_type": "agg",
    "target_namespace": "sources",
    "target_component": "backend",
    "target_endpoint": "generate",
}


def test_a_missing_endpoint_counts_after_the_grace_and_is_reported_once_a_minute() -> None:
    monitor = EventSourceMonitor("demo", grace_s=10.0, repeat_s=60.0)
    first = monitor.evaluate(100.0, [7, 8], {8})
    assert first.mismatched == first.report == first.recovered == []  # within the grace
    matured = monitor.evaluate(110.0, [7, 8], {8})
    assert matured.mismatched == matured.report == [7]
    quiet = monitor.evaluate(111.0, [7, 8], {8})
    assert quiet.mismatched == [7] and quiet.report == []
    assert monitor.evaluate(170.0, [7, 8], {8}).report == [7]  # repeated after a minute
    served = monitor.evaluate(171.0, [7, 8], {7, 8})
    assert served.mismatched == [] and served.recovered == [7]


def test_an_endpoint_served_within_the_grace_never_counts_and_a_departure_clears() -> None:
    monitor = EventSourceMonitor("demo", grace_s=10.0)
    monitor.evaluate(0.0, [7], set())
    assert monitor.evaluate(20.0, [7], {7}).mismatched == []
    # the grace restarts when the endpoint goes missing again
    assert monitor.evaluate(21.0, [7], set()).mismatched == []
    assert monitor.evaluate(31.0, [7], set()).mismatched == [7]
    gone = monitor.evaluate(32.0, [], set())  # the worker left
    assert gone.mismatched == [] and gone.recovered == [7]


def test_a_worker_without_kv_events_counts_at_once_whatever_it_serves() -> None:
    monitor = EventSourceMonitor("demo", grace_s=10.0)
    check = monitor.evaluate(0.0, [7, 8], {7, 8}, silent={8, 9})  # 9: not this router's
    assert check.mismatched == check.report == [8]
    assert monitor.evaluate(1.0, [7, 8], {7, 8}).recovered == [8]  # it publishes again


def card(worker_id: int, kv_events: bool = True) -> ModelCard:
    return make_card(
        worker_id,
        namespace=ENDPOINT.namespace,
        component=ENDPOINT.component,
        endpoint=ENDPOINT.endpoint,
        kv_events=kv_events,
    )


@pytest.fixture
async def runtime() -> AsyncIterator[DistributedRuntime]:
    config = RuntimeConfig(
        namespace=ENDPOINT.namespace,
        discovery_backend="memory",
        request_plane="local",
        event_plane="local",
    )
    made = DistributedRuntime(config, InProcessHub())
    await made.start()
    yield made
    await made.shutdown()


async def until(registry: CollectorRegistry, value: float) -> None:
    async with asyncio.timeout(10):
        while registry.get_sample_value(GAUGE, LABELS) != value:
            await asyncio.sleep(0.01)


async def test_router_counts_a_joined_worker_without_kv_recovery_until_it_leaves(
    runtime: DistributedRuntime,
) -> None:
    registry = CollectorRegistry()
    series = RouterRequestMetrics(registry, 9).bind("sources", "backend", "generate", "agg", "demo")
    settings = KVRouterSettings(consistency_check_interval_s=0)
    router = KVRouter(runtime, "demo", 16, settings, series=series)
    router.event_sources.grace_s = 0.0  # the registration grace is the pure test's business
    router.event_sources.interval_s = 0.01
    await router.start(ENDPOINT)
    try:
        assert registry.get_sample_value(GAUGE, LABELS) == 0.0
        # A worker that serves its local index's query endpoint (as every backend does).
        publisher = KVPublisher(runtime)
        await publisher.serve_recovery(ENDPOINT, [0x51])
        router.add_worker(card(0x51))
        # A worker whose events the router would follow, but that has no kv_recovery.
        router.add_worker(card(0x52))
        await until(registry, 1.0)
        await publisher.serve_recovery(ENDPOINT, [0x52])  # late: it counts no longer
        await until(registry, 0.0)
        router.add_worker(card(0x53))
        await until(registry, 1.0)
        router.remove_worker(0x53)
        await until(registry, 0.0)
        router.add_worker(card(0x54))
        await until(registry, 1.0)
        router.remove_worker(0x54)
        await until(registry, 0.0)
        # A worker that serves kv_recovery but disabled its KV events (the reference counts it).
        await publisher.serve_recovery(ENDPOINT, [0x55])
        router.add_worker(card(0x55, kv_events=False))
        await until(registry, 1.0)
    finally:
        await router.close()
    assert registry.get_sample_value(GAUGE, LABELS) == 0.0  # a closed router expects nothing


async def test_a_router_without_kv_events_watches_nothing(runtime: DistributedRuntime) -> None:
    registry = CollectorRegistry()
    series = RouterRequestMetrics(registry, 9).bind("sources", "backend", "generate", "agg", "demo")
    router = KVRouter(runtime, "demo", 16, KVRouterSettings(use_kv_events=False), series=series)
    router.event_sources.grace_s = 0.0
    router.event_sources.interval_s = 0.01
    await router.start(ENDPOINT)
    try:
        router.add_worker(card(0x61))  # no kv_recovery, and none expected
        await asyncio.sleep(0.1)
        assert registry.get_sample_value(GAUGE, LABELS) == 0.0
    finally:
        await router.close()

"""Instant failover in the endpoint client: an instance reported down leaves the live list at
once and comes back only when a probe over the real TCP request plane gets an answer while
discovery still lists it; a worker that accepts connections but never answers stays down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.context import Context
from dynamo.runtime.endpoint import InstanceInfo, encode_instance
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub

pytestmark = pytest.mark.integration  # real loopback sockets (the TCP request plane), one process

EP = EndpointId("dynamo", "backend", "generate")
CONFIG = RuntimeConfig(discovery_backend="memory", request_plane="tcp", event_plane="local")


async def _echo(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
    yield body


async def _until(pred: object, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def test_a_reported_instance_leaves_at_once_and_returns_after_a_probe() -> None:
    hub = InProcessHub()
    worker, frontend = DistributedRuntime(CONFIG, hub), DistributedRuntime(CONFIG, hub)
    await worker.start()
    await frontend.start()
    try:
        served = await worker.serve_endpoint(EP, _echo)
        client = await frontend.client(EP)
        client._probe_interval = 0.05
        await client.wait_for_instances(1)
        assert client.report_down(served.instance_id)
        assert client.instance_ids() == [] and client.is_down(served.instance_id)
        assert not client.report_down(served.instance_id), "reported once"
        await _until(lambda: client.instance_ids() == [served.instance_id])
        assert not client.is_down(served.instance_id)
    finally:
        await frontend.shutdown()
        await worker.shutdown()


async def test_a_silent_instance_stays_down_until_it_leaves_discovery() -> None:
    hub = InProcessHub()
    frontend = DistributedRuntime(CONFIG, hub)
    await frontend.start()
    accepted: list[asyncio.StreamWriter] = []

    async def never_answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(w)  # like a SIGSTOPped worker: the kernel accepts, nobody answers

    silent = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        info = InstanceInfo(
            namespace=EP.namespace,
            component=EP.component,
            endpoint=EP.endpoint,
            instance_id=0xABC,
            address=f"tcp://127.0.0.1:{port}",
        )
        key = EP.instance_key(0xABC)
        await frontend.discovery.put(key, encode_instance(info), frontend.lease)
        client = await frontend.client(EP)
        client._probe_interval = 0.05
        await client.wait_for_instances(1)
        client.report_down(0xABC)
        await _until(lambda: len(accepted) >= 1)  # probed: connected, never answered
        await asyncio.sleep(0.3)  # several probe intervals
        assert client.instance_ids() == [] and client.is_down(0xABC)
        await frontend.discovery.delete(key)
        await _until(lambda: not client.is_down(0xABC))
        assert client.instance_ids() == []
    finally:
        for w in accepted:
            w.close()
        silent.close()
        await frontend.shutdown()

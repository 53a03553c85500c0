"""EtcdDiscovery against a real etcd: what only etcd has (the range end of a prefix, a server
restarted mid-run). The discovery contract itself runs against etcd in
``test_discovery_contract.py``, with the memory and file backends."""

from __future__ import annotations

import asyncio

from dynamo.runtime.discovery.base import WatchEvent, WatchEventKind
from dynamo.runtime.discovery.etcd import EtcdDiscovery
from dynamo.runtime.discovery.etcd_gateway import prefix_range_end
from tests.servers import EtcdServer
from tests.unit.runtime.discovery_kit import next_event, no_event

PUT, DELETE = WatchEventKind.PUT, WatchEventKind.DELETE


def test_prefix_range_end() -> None:
    assert prefix_range_end(b"a/") == b"a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"") == b"\0"


async def test_etcd_restart_resumes_watches_without_loss_or_duplicates(
    etcd_server: EtcdServer,
) -> None:
    worker, frontend = EtcdDiscovery([etcd_server.endpoint]), EtcdDiscovery([etcd_server.endpoint])
    try:
        # The lease must outlive the restart (stop + start of etcd takes seconds on a loaded
        # machine): a lease that expired meanwhile is a different scenario.
        lease = await worker.grant_lease(8.0)
        await worker.put("v1/instances/w1", b"1", lease)
        watch = await frontend.watch_prefix("v1/instances/")
        assert [kv.key for kv in watch.snapshot] == ["v1/instances/w1"]
        await worker.put("v1/instances/w2", b"2", lease)
        assert await next_event(watch) == WatchEvent(PUT, "v1/instances/w2", b"2")

        await asyncio.to_thread(etcd_server.restart)
        # A change made while the watch reconnects is delivered once; none is replayed.
        await worker.put("v1/instances/w3", b"3", lease)
        assert await next_event(watch, timeout=15) == WatchEvent(PUT, "v1/instances/w3", b"3")
        assert await no_event(watch, wait=1.0)
        await asyncio.sleep(lease.ttl / 3 + 1)  # a keepalive after the restart
        assert lease.is_alive()
        assert [kv.key for kv in await frontend.get_prefix("v1/instances/")] == [
            "v1/instances/w1",
            "v1/instances/w2",
            "v1/instances/w3",
        ]
        await worker.delete("v1/instances/w1")
        assert await next_event(watch) == WatchEvent(DELETE, "v1/instances/w1")
    finally:
        await worker.close()
        await frontend.close()

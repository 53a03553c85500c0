"""A worker whose discovery lease is lost (its process hung past the TTL) shuts down."""

from __future__ import annotations

import asyncio

from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.discovery.memory import MemoryLease
from tests.fakes import CountingEngine


async def test_lost_lease_shuts_the_worker_down() -> None:
    config = WorkerConfig(
        runtime=RuntimeConfig(
            # 1 s: a loaded machine's stall before the suspension must not expire it first
            # (the worker would stop before it is ready); 0.3 s was close to such stalls
            discovery_backend="memory",
            request_plane="local",
            event_plane="local",
            lease_ttl=1.0,
        ),
        install_signal_handlers=False,
    )
    engine = CountingEngine()
    worker = Worker([engine], config)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 5)
    lease = worker.runtime.lease
    assert isinstance(lease, MemoryLease)
    lease.suspend_keepalive()  # the process "hangs": nobody refreshes the lease
    await asyncio.wait_for(task, 5)
    assert engine.events[-1] == "cleanup"

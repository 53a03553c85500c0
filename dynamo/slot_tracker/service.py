"""The slot tracker process: registry + optional replica sync + HTTP server + expiry sweep."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from dynamo.router.sequences import EXPIRY_CHECK_INTERVAL_S
from dynamo.runtime.http_limits import raise_fd_limit
from dynamo.runtime.http_server import HttpServer
from dynamo.slot_tracker.app import SlotTrackerApp
from dynamo.slot_tracker.config import SlotTrackerConfig
from dynamo.slot_tracker.registry import Registry
from dynamo.slot_tracker.replica import ReplicaSync

log = logging.getLogger(__name__)


class SlotTrackerService:
    """Owns every part of one slot tracker. ``start()`` then ``stop()``; both run on one loop.

    After ``start()``, ``port`` is the bound HTTP port and ``replica.bound_endpoint`` the bound
    ZMQ endpoint (when replica sync is on).
    """

    def __init__(self, config: SlotTrackerConfig) -> None:
        self.config = config
        self.registry = Registry(expiry_s=config.active_request_expiry_s)
        self.replica: ReplicaSync | None = None
        if config.replica_sync_bind is not None:
            self.replica = ReplicaSync(
                self.registry,
                bind=config.replica_sync_bind,
                advertise=config.replica_sync_advertise,
                peers=config.replica_sync_peers,
                queue_size=config.replica_queue_size,
            )
        self.app = SlotTrackerApp(self.registry, self.replica)
        self._http = HttpServer(
            self.app,
            config.host,
            config.port,
            max_body_bytes=config.max_body_bytes,
            write_behind=True,
            busy_poll_s=config.busy_poll_us * 1e-6,
            limits=config.limits,
        )
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return self._http.port

    async def start(self) -> None:
        # the connection limit, not EMFILE, is what a flood of sockets should meet
        raise_fd_limit(self.config.limits.max_connections + 1024)
        if self.replica is not None:
            await self.replica.start()
        try:
            await self._http.start()
        except BaseException:
            if self.replica is not None:
                await self.replica.stop()
            raise
        self._sweeper = asyncio.create_task(self._sweep(), name="slot-tracker-expiry")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self._http.stop()
        if self.replica is not None:
            await self.replica.stop()

    async def _sweep(self) -> None:
        # add_request also sweeps its own tracker; this covers trackers that stopped adding.
        while True:
            await asyncio.sleep(EXPIRY_CHECK_INTERVAL_S)
            self.registry.expire_stale()

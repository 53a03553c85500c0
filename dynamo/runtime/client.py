"""A client over one endpoint: the live instance list, and streams to one chosen instance.

The instance list follows a discovery watch: an instance that leaves discovery cannot be sent to
again. Choosing the instance is the caller's business (the frontend's routers in
``dynamo/router``); a request to an instance that is not live raises :class:`NoInstances`.

Instant failover: a caller whose stream to an instance failed in a way that implicates the
instance (connection refused or reset, a stream cut short, no answer in time, the worker
shutting down) reports it with :meth:`EndpointClient.report_down`. The instance leaves the live
list at once, without waiting for its discovery lease to expire, and comes back only if discovery
still lists it when a probe succeeds: every ``probe_interval`` seconds a request to a route no
worker serves goes to each instance that is down; the worker's request-plane server answering it
(``NoInstances``) within the timeout shows its loop is alive. A hung worker (SIGSTOP) accepts
the connection but never answers, so it stays down until its lease expires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from dynamo.runtime.context import Context
from dynamo.runtime.deferred_log import log_later
from dynamo.runtime.discovery.base import Discovery
from dynamo.runtime.discovery.follower import PrefixFollower
from dynamo.runtime.endpoint import InstanceInfo, decode_instance
from dynamo.runtime.errors import DynamoError, NoInstances
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.request_plane.base import RequestPlaneClient

log = logging.getLogger(__name__)

PROBE_ROUTE = "__probe__"
"""An endpoint name no worker serves: a probe sent there is answered ``NoInstances``."""


class EndpointClient:
    """Watches an endpoint's instances and sends requests to them.

    Owned by one task: ``start()`` creates the watch task, ``close()`` cancels it.
    """

    def __init__(
        self,
        endpoint_id: EndpointId,
        discovery: Discovery,
        transport: RequestPlaneClient,
        *,
        probe_interval: float = 1.0,
    ) -> None:
        if probe_interval <= 0:
            raise ValueError("probe_interval must be positive")
        self.endpoint_id = endpoint_id
        self._discovery = discovery
        self._transport = transport
        self._probe_interval = probe_interval
        self._instances: dict[int, InstanceInfo] = {}
        self._down: set[int] = set()
        self._probe_task: asyncio.Task[None] | None = None
        self._ids: list[int] = []
        self._follower: PrefixFollower | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        self._follower = PrefixFollower(
            self._discovery,
            self.endpoint_id.instances_prefix(),
            self._apply_put,
            self._apply_delete,
            name=f"client-watch:{self.endpoint_id}",
        )
        await self._follower.start()

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
            self._probe_task = None
        if self._follower is not None:
            await self._follower.close()
            self._follower = None

    def _apply_put(self, key: str, value: bytes) -> None:
        try:
            info = decode_instance(value)
        except Exception:  # a malformed record must not kill the watch
            log.warning("ignoring malformed instance record at %s", key)
            return
        self._instances[info.instance_id] = info
        self._refresh()

    def _apply_delete(self, key: str) -> None:
        suffix = key.rsplit("/", 1)[-1]
        try:
            instance_id = int(suffix, 16)
        except ValueError:
            return
        self._down.discard(instance_id)
        if self._instances.pop(instance_id, None) is not None:
            self._refresh()

    def _refresh(self) -> None:
        self._ids = sorted(i for i in self._instances if i not in self._down)
        self._changed.set()
        self._changed = asyncio.Event()

    # -- failover ----------------------------------------------------------------------
    def report_down(self, instance_id: int) -> bool:
        """Take ``instance_id`` out of the live list now (see the module docstring). Returns
        True if it was live until now."""
        if instance_id not in self._instances or instance_id in self._down:
            return False
        self._down.add(instance_id)
        self._refresh()
        # Written after the continuations of its streams have been sent (``log_later``).
        log_later(
            log,
            logging.WARNING,
            "instance %x of %s is down: out of routing",
            instance_id,
            self.endpoint_id,
        )
        if self._probe_task is None:
            self._probe_task = asyncio.get_running_loop().create_task(
                self._probe_down(), name=f"client-probe:{self.endpoint_id}"
            )
        return True

    def is_down(self, instance_id: int) -> bool:
        return instance_id in self._down

    async def _probe_down(self) -> None:
        try:
            while self._down:
                await asyncio.sleep(self._probe_interval)
                for instance_id in list(self._down):
                    info = self._instances.get(instance_id)
                    if info is None:  # left discovery meanwhile
                        self._down.discard(instance_id)
                    elif await self.probe(info) and instance_id in self._down:
                        self._down.discard(instance_id)
                        self._refresh()
                        log.info("instance %x of %s answers again", instance_id, self.endpoint_id)
        finally:
            self._probe_task = None

    async def probe(self, info: InstanceInfo) -> bool:
        """Whether the request-plane server of ``info`` answers a request within the probe
        interval (any answer but ``WorkerShutdown``: the probe's route is never served)."""
        route = f"{self.endpoint_id.path}/{PROBE_ROUTE}"
        try:
            async with asyncio.timeout(self._probe_interval):
                async for _ in self._transport.stream(info.address, route, b"", Context()):
                    pass
        except NoInstances:
            return True
        except (DynamoError, TimeoutError, OSError):
            return False
        return True

    # -- queries -----------------------------------------------------------------------
    def instance_ids(self) -> list[int]:
        return list(self._ids)

    def instances(self) -> list[InstanceInfo]:
        return [self._instances[i] for i in self._ids]

    async def wait_for_instances(self, count: int = 1, timeout: float = 10.0) -> list[int]:
        """Wait until at least ``count`` instances are live."""
        async with asyncio.timeout(timeout):
            while len(self._ids) < count:
                await self._changed.wait()
        return self.instance_ids()

    # -- requests ----------------------------------------------------------------------
    def stream(self, body: bytes, ctx: Context, *, instance_id: int) -> AsyncGenerator[bytes, None]:
        """Send ``body`` to the live instance ``instance_id``; iterate its response bodies."""
        info = self._instances.get(instance_id)
        if info is None:
            raise NoInstances(f"instance {instance_id:x} of {self.endpoint_id} is not live")
        route = self.endpoint_id.instance_path(instance_id)
        return self._transport.stream(info.address, route, body, ctx)

    def stream_batches(
        self, body: bytes, ctx: Context, *, instance_id: int
    ) -> AsyncGenerator[list[bytes], None]:
        """Like :meth:`stream` to one instance, yielding the bodies received so far as a list."""
        info = self._instances.get(instance_id)
        if info is None:
            raise NoInstances(f"instance {instance_id:x} of {self.endpoint_id} is not live")
        route = self.endpoint_id.instance_path(instance_id)
        return self._transport.stream_batches(info.address, route, body, ctx)

"""A client over one endpoint: the live instance list, and streams to one chosen instance.

The instance list follows a discovery watch: an instance that leaves discovery cannot be sent to
again. Choosing the instance is the caller's business (the frontend's routers in
``dynamo/router``); a request to an instance that is not live raises :class:`NoInstances`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from dynamo.runtime.context import Context
from dynamo.runtime.discovery.base import Discovery, Watch, WatchEventKind
from dynamo.runtime.endpoint import InstanceInfo, decode_instance
from dynamo.runtime.errors import NoInstances
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.request_plane.base import RequestPlaneClient

log = logging.getLogger(__name__)


class EndpointClient:
    """Watches an endpoint's instances and sends requests to them.

    Owned by one task: ``start()`` creates the watch task, ``close()`` cancels it.
    """

    def __init__(
        self,
        endpoint_id: EndpointId,
        discovery: Discovery,
        transport: RequestPlaneClient,
    ) -> None:
        self.endpoint_id = endpoint_id
        self._discovery = discovery
        self._transport = transport
        self._instances: dict[int, InstanceInfo] = {}
        self._ids: list[int] = []
        self._watch: Watch | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        self._watch = await self._discovery.watch_prefix(self.endpoint_id.instances_prefix())
        for kv in self._watch.snapshot:
            self._apply_put(kv.key, kv.value)
        self._task = asyncio.create_task(self._follow(), name=f"client-watch:{self.endpoint_id}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._watch is not None:
            await self._watch.close()
            self._watch = None

    async def _follow(self) -> None:
        assert self._watch is not None
        async for event in self._watch:
            if event.kind is WatchEventKind.PUT:
                self._apply_put(event.key, event.value)
            else:
                self._apply_delete(event.key)

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
        if self._instances.pop(instance_id, None) is not None:
            self._refresh()

    def _refresh(self) -> None:
        self._ids = sorted(self._instances)
        self._changed.set()
        self._changed = asyncio.Event()

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

"""``DistributedRuntime``: builds the planes from configuration and owns their start/stop order.

This is the one place where concrete backends are chosen. Start order: discovery -> primary lease
-> event plane -> request-plane server (lazily, on the first served endpoint). Stop order is the
reverse: served endpoints leave discovery first, then the request-plane server stops (in-flight
handlers are cancelled), clients close, the event plane closes, the lease is revoked and discovery
closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynamo.protocol.kv_events import KV_EVENTS_TOPIC
from dynamo.runtime.client import EndpointClient
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.discovery.base import Discovery, Lease
from dynamo.runtime.discovery.file import FileDiscovery
from dynamo.runtime.discovery.memory import MemoryDiscovery, MemoryStore
from dynamo.runtime.endpoint import InstanceInfo, encode_instance
from dynamo.runtime.event_plane.base import EventPlane
from dynamo.runtime.event_plane.local import LocalEventBus, LocalEventPlane
from dynamo.runtime.event_plane.zmq import ZmqEventPlane
from dynamo.runtime.naming import EndpointId, new_instance_id
from dynamo.runtime.request_plane.base import Handler, RequestPlaneClient, RequestPlaneServer
from dynamo.runtime.request_plane.local import (
    LocalHub,
    LocalRequestPlaneClient,
    LocalRequestPlaneServer,
)
from dynamo.runtime.request_plane.tcp_client import TCPRequestPlaneClient
from dynamo.runtime.request_plane.tcp_server import TCPRequestPlaneServer
from dynamo.runtime.work_queue.base import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_REDELIVERY_TIMEOUT,
    WorkQueue,
)
from dynamo.runtime.work_queue.local import LocalQueueStore, LocalWorkQueue
from dynamo.runtime.work_queue.served import QueueHost, ServedWorkQueue
from dynamo.runtime.work_queue.served import endpoint_id as served_queue_endpoint

if TYPE_CHECKING:
    # NATS (client, event plane, JetStream queues) is imported where it is used: a process on
    # file discovery and ZMQ events never loads it (~4 MiB; runtime/huge_pages.py says why a
    # worker's memory matters).
    from nats.aio.client import Client as NatsClient

log = logging.getLogger(__name__)


@dataclass
class InProcessHub:
    """Shared state of the one-process shape: several runtimes in one process see each other
    through it (memory discovery, local request plane, local event plane)."""

    store: MemoryStore = field(default_factory=MemoryStore)
    requests: LocalHub = field(default_factory=LocalHub)
    events: LocalEventBus = field(default_factory=LocalEventBus)
    queues: LocalQueueStore = field(default_factory=LocalQueueStore)


@dataclass
class ServedEndpoint:
    endpoint_id: EndpointId
    instance_id: int
    key: str


class DistributedRuntime:
    """One per process (or per simulated process in the one-process shape)."""

    def __init__(self, config: RuntimeConfig, hub: InProcessHub | None = None) -> None:
        if hub is None and (
            config.discovery_backend == "memory"
            or config.request_plane == "local"
            or config.event_plane == "local"
        ):
            hub = InProcessHub()
        self.config = config
        self._hub = hub
        self._discovery: Discovery | None = None
        self._lease: Lease | None = None
        self._events: EventPlane | None = None
        self._nats: NatsClient | None = None
        self._server: RequestPlaneServer | None = None
        self._transport: RequestPlaneClient | None = None
        self._served: dict[tuple[EndpointId, int], ServedEndpoint] = {}
        self._clients: list[EndpointClient] = []
        self._queues: list[WorkQueue] = []
        self._queue_host: QueueHost | None = None
        self._started = False
        self._stopped = False
        self._lease_watch: asyncio.Task[None] | None = None
        self._lease_lost_callbacks: list[Callable[[], None]] = []

    @property
    def namespace(self) -> str:
        return self.config.namespace

    @property
    def hub(self) -> InProcessHub | None:
        return self._hub

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._discovery = self._make_discovery()
        self._lease = await self._discovery.grant_lease(self.config.lease_ttl)
        self._lease_watch = asyncio.create_task(self._watch_lease(), name="runtime-lease-watch")
        if self.config.event_plane == "nats":
            from dynamo.runtime.nats_client import connect_nats

            self._nats = await connect_nats(self.config.nats_server, name=self.namespace)
        self._events = self._make_event_plane()
        await self._events.start()

    def on_lease_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` if the primary lease is lost (keepalive failed past the TTL):
        every key of this process is gone from discovery, so its owner should shut down (as the
        reference runtime does) rather than run on unseen."""
        self._lease_lost_callbacks.append(callback)

    async def _watch_lease(self) -> None:
        lease = self._lease
        assert lease is not None
        interval = max(0.05, self.config.lease_ttl / 3)
        while lease.is_alive():
            await asyncio.sleep(interval)
        if self._stopped:
            return
        log.error("discovery lease %x lost: this process's registrations are gone", lease.id)
        for callback in self._lease_lost_callbacks:
            callback()

    async def shutdown(self) -> None:
        """Tear everything down in reverse order (idempotent)."""
        if self._stopped or not self._started:
            self._stopped = True
            return
        self._stopped = True
        if self._lease_watch is not None:
            self._lease_watch.cancel()
            await asyncio.gather(self._lease_watch, return_exceptions=True)
        for queue in self._queues:  # first: a handle gives its unsettled items back
            await queue.close()
        if self._queue_host is not None:
            await self._queue_host.close()
        for served in list(self._served.values()):
            await self.unserve(served)
        if self._server is not None:
            await self._server.stop()
        for client in self._clients:
            await client.close()
        if self._transport is not None:
            await self._transport.close()
        if self._events is not None:
            await self._events.close()
        if self._nats is not None:
            await self._nats.close()
        if self._lease is not None:
            await self._lease.revoke()
        if self._discovery is not None:
            await self._discovery.close()

    # -- accessors -----------------------------------------------------------------------
    @property
    def discovery(self) -> Discovery:
        if self._discovery is None:
            raise RuntimeError("runtime not started")
        return self._discovery

    @property
    def lease(self) -> Lease:
        if self._lease is None:
            raise RuntimeError("runtime not started")
        return self._lease

    @property
    def events(self) -> EventPlane:
        if self._events is None:
            raise RuntimeError("runtime not started")
        return self._events

    @property
    def transport(self) -> RequestPlaneClient:
        if self._transport is None:
            self._transport = self._make_transport()
        return self._transport

    async def server(self) -> RequestPlaneServer:
        """The process's one request-plane server, started on first use."""
        if self._server is None:
            self._server = self._make_server()
            await self._server.start()
        return self._server

    # -- endpoints -----------------------------------------------------------------------
    async def serve_endpoint(
        self, endpoint_id: EndpointId, handler: Handler, *, instance_id: int | None = None
    ) -> ServedEndpoint:
        """Serve ``handler`` and register a new instance of ``endpoint_id`` in discovery."""
        server = await self.server()
        iid = instance_id if instance_id is not None else new_instance_id()
        if (endpoint_id, iid) in self._served:
            raise ValueError(f"instance {iid:x} of {endpoint_id} is already served")
        server.register(endpoint_id.instance_path(iid), handler)
        info = InstanceInfo(
            namespace=endpoint_id.namespace,
            component=endpoint_id.component,
            endpoint=endpoint_id.endpoint,
            instance_id=iid,
            address=server.address,
        )
        key = endpoint_id.instance_key(iid)
        await self.discovery.put(key, encode_instance(info), self.lease)
        served = ServedEndpoint(endpoint_id, iid, key)
        self._served[(endpoint_id, iid)] = served
        return served

    async def unserve(self, served: ServedEndpoint) -> None:
        """Leave discovery first (no new requests), then stop accepting on the server."""
        if self._served.pop((served.endpoint_id, served.instance_id), None) is None:
            return
        try:
            await self.discovery.delete(served.key)
        except Exception:  # discovery may already be gone during teardown
            log.warning("could not delete %s from discovery", served.key, exc_info=True)
        if self._server is not None:
            self._server.unregister(served.endpoint_id.instance_path(served.instance_id))

    async def client(self, endpoint_id: EndpointId) -> EndpointClient:
        """A started client over ``endpoint_id``; closed with the runtime."""
        client = EndpointClient(endpoint_id, self.discovery, self.transport)
        await client.start()
        self._clients.append(client)
        return client

    async def work_queue(
        self,
        name: str,
        *,
        max_depth: int = DEFAULT_MAX_DEPTH,
        redelivery_timeout: float = DEFAULT_REDELIVERY_TIMEOUT,
        host: bool = False,
    ) -> WorkQueue:
        """A started handle on the namespace's work queue ``name``; closed with the runtime.

        Every process of the namespace that opens ``name`` shares one queue. Its limits are set
        by the first opener; later openers must pass the same ones. ``host``: this process
        keeps the items when the queue is served over the request plane (no NATS, several
        processes: ``work_queue/served.py``; the producer hosts); ignored by the backends
        whose items live in a shared store (JetStream, the in-process hub).
        """
        queue = await self._make_work_queue(
            f"{self.namespace}.{name}",
            max_depth=max_depth,
            redelivery_timeout=redelivery_timeout,
            host=host,
        )
        await queue.start()
        self._queues.append(queue)
        return queue

    # -- backend choice (the one place) --------------------------------------------------
    def _make_discovery(self) -> Discovery:
        backend = self.config.discovery_backend
        if backend == "memory":
            assert self._hub is not None
            return MemoryDiscovery(self._hub.store)
        if backend == "etcd":
            # Imported here: its HTTP client (httpx, which loads its command-line tool's
            # click/rich/pygments too) is ~13 MiB and ~0.4 s of start-up that a process on
            # file or memory discovery never uses; a worker's memory is what a SIGKILL tears
            # down before its sockets close (runtime/huge_pages.py).
            from dynamo.runtime.discovery.etcd import EtcdDiscovery

            return EtcdDiscovery(list(self.config.etcd_endpoints))
        return FileDiscovery(self.config.discovery_dir)

    def _make_event_plane(self) -> EventPlane:
        if self.config.event_plane == "local":
            assert self._hub is not None
            return LocalEventPlane(self._hub.events)
        if self.config.event_plane == "nats":
            from dynamo.runtime.event_plane.nats import NatsEventPlane

            assert self._nats is not None
            return NatsEventPlane(
                self._nats, self.config.namespace, stored_topics=(KV_EVENTS_TOPIC,)
            )
        return ZmqEventPlane(
            self.discovery,
            self.config.namespace,
            host=self.config.host,
            advertise_host=self.config.advertise_host,
            lease=self.lease,
        )

    def _make_server(self) -> RequestPlaneServer:
        if self.config.request_plane == "local":
            assert self._hub is not None
            return LocalRequestPlaneServer(self._hub.requests)
        return TCPRequestPlaneServer(
            host=self.config.host,
            port=0,
            advertise_host=self.config.advertise_host,
            max_frame_size=self.config.tcp_max_message_size,
            max_inflight=self.config.tcp_max_inflight,
            max_connections=self.config.tcp_max_connections,
            frame_timeout_s=self.config.tcp_frame_timeout_s,
        )

    def _make_transport(self) -> RequestPlaneClient:
        if self.config.request_plane == "local":
            assert self._hub is not None
            return LocalRequestPlaneClient(self._hub.requests)
        return TCPRequestPlaneClient(max_frame_size=self.config.tcp_max_message_size)

    async def _make_work_queue(
        self, name: str, *, max_depth: int, redelivery_timeout: float, host: bool
    ) -> WorkQueue:
        if self._nats is not None:
            from dynamo.runtime.work_queue.jetstream import JetStreamWorkQueue

            return JetStreamWorkQueue(
                self._nats, name, max_depth=max_depth, redelivery_timeout=redelivery_timeout
            )
        if self._hub is None:
            queue_host = None
            if host:
                if self._queue_host is None:
                    self._queue_host = QueueHost()
                    await self.serve_endpoint(
                        served_queue_endpoint(self.namespace), self._queue_host.handle
                    )
                queue_host = self._queue_host
            return ServedWorkQueue(
                await self.client(served_queue_endpoint(self.namespace)),
                name,
                max_depth=max_depth,
                redelivery_timeout=redelivery_timeout,
                host=queue_host,
            )
        return LocalWorkQueue(
            self._hub.queues, name, max_depth=max_depth, redelivery_timeout=redelivery_timeout
        )

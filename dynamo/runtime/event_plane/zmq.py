"""ZMQ event plane: one PUB socket per process, advertised in discovery; each subscription is a
SUB socket connected to every publisher advertised in the namespace (found through a watch).

Wire: multipart ``[topic (UTF-8), header (publisher_id u64, seq u64; big-endian), payload]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from dynamo.runtime.discovery.base import Discovery, Lease
from dynamo.runtime.discovery.follower import PrefixFollower
from dynamo.runtime.event_plane.base import EventMessage
from dynamo.runtime.naming import event_publishers_prefix, new_instance_id

_log = logging.getLogger(__name__)

_HEADER = struct.Struct(">QQ")
# Per-peer queue bounds: when a subscriber falls this far behind, its PUB pipe drops new messages
# (the receiver sees the gap in seq) instead of blocking the publisher or growing without bound.
DEFAULT_SNDHWM = 10_000
DEFAULT_RCVHWM = 10_000
_MAX_BURST = 64  # messages a subscription returns without yielding to the event loop


class PublisherInfo(msgspec.Struct, frozen=True):
    """Discovery value under ``event_publishers_prefix(namespace) + f"{publisher_id:x}"``."""

    publisher_id: int
    endpoint: str


_decode_info = msgspec.json.Decoder(PublisherInfo).decode


def _decode_frames(frames: list[bytes]) -> EventMessage | None:
    if len(frames) != 3 or len(frames[1]) != _HEADER.size:
        return None
    try:
        topic = frames[0].decode()
    except UnicodeDecodeError:
        return None
    publisher_id, seq = _HEADER.unpack(frames[1])
    return EventMessage(topic, publisher_id, seq, frames[2])


class ZmqSubscription:
    """A SUB socket filtered on ``prefix``; the plane connects it to every known publisher.

    Iteration stops when the subscription (or its plane) is closed. ``malformed`` counts frames
    that were not ``[topic, header, payload]`` (skipped).
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        prefix: str,
        on_close: Callable[[ZmqSubscription], None],
    ) -> None:
        self.prefix = prefix
        self.malformed = 0
        self._sock = sock
        # A synchronous view of the same socket: queued messages are taken without a future.
        self._direct: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._burst = 0
        self._on_close = on_close
        self._closed = False

    def connect(self, endpoint: str) -> None:
        self._sock.connect(endpoint)

    def disconnect(self, endpoint: str) -> None:
        with contextlib.suppress(zmq.ZMQError):  # never connected: nothing to undo
            self._sock.disconnect(endpoint)

    def __aiter__(self) -> ZmqSubscription:
        return self

    async def __anext__(self) -> EventMessage:
        while not self._closed:
            try:
                frames = await self._recv()
            except asyncio.CancelledError:
                # close() cancels a pending recv: that ends iteration, unless our task is cancelled.
                task = asyncio.current_task()
                if self._closed and (task is None or not task.cancelling()):
                    raise StopAsyncIteration from None
                raise
            except zmq.ZMQError:
                if self._closed:
                    raise StopAsyncIteration from None
                raise
            message = _decode_frames(frames)
            if message is not None:
                return message
            self.malformed += 1
        raise StopAsyncIteration

    async def _recv(self) -> list[bytes]:
        if self._burst >= _MAX_BURST:
            self._burst = 0
            await asyncio.sleep(0)  # a flood must not starve the rest of the loop
        try:
            frames = self._direct.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            self._burst = 0
            return await self._sock.recv_multipart()
        self._burst += 1
        return frames

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._on_close(self)
        self._sock.close(linger=0)


class ZmqEventPlane:
    """:class:`EventPlane` over ZMQ PUB/SUB, with publishers found through ``discovery``.

    ``start()`` binds the PUB socket on ``tcp://{host}:0`` and advertises it, with
    ``advertise_host`` (default ``host``: then it must be reachable by peers) in place of the bind
    address, under ``lease``; without one, the plane grants and owns a lease of
    ``lease_ttl`` seconds. Either way the advertisement vanishes when the process dies.
    ``close()`` withdraws it, closes every socket and awaits its task.
    """

    def __init__(
        self,
        discovery: Discovery,
        namespace: str,
        *,
        host: str = "127.0.0.1",
        advertise_host: str = "",
        lease: Lease | None = None,
        lease_ttl: float = 10.0,
        sndhwm: int = DEFAULT_SNDHWM,
        rcvhwm: int = DEFAULT_RCVHWM,
    ) -> None:
        self._discovery = discovery
        self._host = host
        self._advertise_host = advertise_host
        self._lease = lease
        self._lease_ttl = lease_ttl
        self._own_lease: Lease | None = None
        self._sndhwm = sndhwm
        self._rcvhwm = rcvhwm
        self._publisher_id = new_instance_id()
        self._prefix = event_publishers_prefix(namespace)
        self._key = f"{self._prefix}{self._publisher_id:x}"
        self.endpoint: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._seqs: dict[str, int] = {}
        self._subscriptions: list[ZmqSubscription] = []
        self._publishers: dict[str, str] = {}  # discovery key -> endpoint
        # Keys per endpoint: a dead publisher's key may outlive it while a new one reuses its port.
        self._endpoints: dict[str, int] = {}  # connected once: twice would duplicate messages
        self._follower: PrefixFollower | None = None
        self._watch_lock = asyncio.Lock()
        self._closed = False

    @property
    def publisher_id(self) -> int:
        return self._publisher_id

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("event plane is closed")
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        # A plain (synchronous) socket: PUB sends never block, so publish needs no future.
        pub = self._pub = zmq.Socket(self._ctx, zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._sndhwm)
        pub.setsockopt(zmq.IPV6, int(":" in self._host))
        try:
            pub.bind(f"tcp://[{self._host}]:0" if ":" in self._host else f"tcp://{self._host}:0")
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self._advertise_host:
                port = self.endpoint.rsplit(":", 1)[1]
                host = self._advertise_host
                self.endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            lease = self._lease
            if lease is None:
                lease = self._own_lease = await self._discovery.grant_lease(self._lease_ttl)
            info = PublisherInfo(publisher_id=self._publisher_id, endpoint=self.endpoint)
            await self._discovery.put(self._key, msgspec.json.encode(info), lease)
        except BaseException:
            await self.close()
            raise

    async def publish(self, topic: str, payload: bytes) -> None:
        pub = self._pub
        if pub is None or self._closed:
            raise RuntimeError("event plane is not started or closed")
        seq = self._seqs.get(topic, 0)
        self._seqs[topic] = seq + 1
        header = _HEADER.pack(self._publisher_id, seq)
        with contextlib.suppress(zmq.Again):  # PUB drops at its HWM instead; kept as a guard
            pub.send_multipart((topic.encode(), header, payload), flags=zmq.NOBLOCK)

    async def subscribe(self, topic_prefix: str) -> ZmqSubscription:
        """A subscription connected to every known publisher, and to later ones as they appear.

        ZMQ connects asynchronously: messages published right after this returns may be missed.
        """
        if self._ctx is None or self._closed:
            raise RuntimeError("event plane is not started or closed")
        await self._ensure_watch()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SUBSCRIBE, topic_prefix.encode())
        subscription = ZmqSubscription(sock, topic_prefix, self._subscriptions.remove)
        for endpoint in self._endpoints:
            subscription.connect(endpoint)
        self._subscriptions.append(subscription)
        return subscription

    async def _ensure_watch(self) -> None:
        async with self._watch_lock:
            if self._follower is not None:
                return
            follower = PrefixFollower(
                self._discovery,
                self._prefix,
                self._on_put,
                self._on_delete,
                name=f"zmq-event-publishers-{self._prefix}",
            )
            await follower.start()
            self._follower = follower

    def _on_put(self, key: str, value: bytes) -> None:
        try:
            endpoint = _decode_info(value).endpoint
        except msgspec.DecodeError:
            _log.warning("ignoring malformed event publisher record %s", key)
            return
        old = self._publishers.get(key)
        if old == endpoint:
            return
        if old is not None:
            self._on_delete(key)
        self._publishers[key] = endpoint
        self._endpoints[endpoint] = self._endpoints.get(endpoint, 0) + 1
        if self._endpoints[endpoint] == 1:
            for subscription in self._subscriptions:
                subscription.connect(endpoint)

    def _on_delete(self, key: str) -> None:
        endpoint = self._publishers.pop(key, None)
        if endpoint is None:
            return
        self._endpoints[endpoint] -= 1
        if self._endpoints[endpoint] == 0:
            del self._endpoints[endpoint]
            for subscription in self._subscriptions:
                subscription.disconnect(endpoint)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        follower, self._follower = self._follower, None
        try:
            if follower is not None:
                await follower.close()
            for subscription in list(self._subscriptions):
                await subscription.close()
            # Withdraw the advertisement before the socket goes away.
            if self._own_lease is not None:
                await self._own_lease.revoke()
            elif self.endpoint is not None:
                await self._discovery.delete(self._key)
        except Exception:  # discovery may already be gone during teardown
            _log.warning("could not withdraw event publisher %s", self._key, exc_info=True)
        finally:
            if self._pub is not None:
                self._pub.close(linger=0)
                self._pub = None
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None

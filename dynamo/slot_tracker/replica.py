"""Replica sync between slot trackers over ZMQ PUB/SUB (spec 001).

Local lifecycle writes go out on a PUB socket through a bounded, best-effort queue; peers' events
come in on one SUB socket connected to every configured peer and are applied to the registry.
No acknowledgement, replay or gap recovery: peer state is advisory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from collections import deque
from collections.abc import Iterable, Sequence

import msgspec
import zmq
import zmq.asyncio

from dynamo.slot_tracker.registry import Registry, TrackerKey

log = logging.getLogger(__name__)

TOPIC = b"dynamo-py.slot-tracker.v1"
DEFAULT_QUEUE_SIZE = 100_000
_TCP = re.compile(r"^tcp://(?P<host>\[[0-9a-fA-F:.]+\]|[^:/\s]+):(?P<port>\*|\d{1,5})$")


class ReplicaEvent(msgspec.Struct, array_like=True, gc=False):
    """One lifecycle write, as sent between replicas (msgpack, positional)."""

    origin: int  # the sender's ephemeral process identity
    model_name: str
    tenant_id: str
    block_size: int
    op: int  # registry.Op
    request_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: list[int] = []
    new_isl_tokens: int = 0


class PeerError(ValueError):
    """A peer URL the replica refuses (status 400) or cannot serve (409: sync disabled)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def validate_endpoint(url: str, *, bind: bool = False) -> None:
    """Accept ``tcp://host:port`` (``*`` host or port only when binding), ``ipc://`` and
    ``inproc://`` endpoints; raise PeerError otherwise."""
    if url.startswith(("ipc://", "inproc://")):
        if url.split("://", 1)[1]:
            return
        raise PeerError(f"invalid endpoint {url!r}: empty address")
    match = _TCP.match(url)
    if match is None:
        raise PeerError(f"invalid endpoint {url!r}: expected tcp://host:port")
    host, port = match["host"], match["port"]
    if not bind and (host == "*" or port == "*"):
        raise PeerError(f"invalid endpoint {url!r}: wildcards are only allowed when binding")
    if port != "*" and (int(port) > 65535 or (int(port) == 0 and not bind)):
        raise PeerError(f"invalid endpoint {url!r}: bad port")


class ReplicaSync:
    """Owns the PUB and SUB sockets, the outbound queue and the two tasks that drain them.

    ``publish`` is the registry's publisher: it never blocks and never raises; when
    ``queue_size`` events are already waiting, the new event is dropped (``dropped`` counts).
    Events whose origin is this process are ignored on receipt. Lifecycle: ``start()`` binds and
    connects (raising on a bad endpoint), ``stop()`` cancels and awaits both tasks, then closes.
    """

    def __init__(
        self,
        registry: Registry,
        *,
        bind: str,
        advertise: str | None = None,
        peers: Iterable[str] = (),
        queue_size: int = DEFAULT_QUEUE_SIZE,
    ) -> None:
        validate_endpoint(bind, bind=True)
        if advertise is not None:
            validate_endpoint(advertise)
        if queue_size <= 0:
            raise ValueError("queue_size must be positive")
        self.origin = secrets.randbits(64) or 1
        self._registry = registry
        self._bind = bind
        self._advertise = advertise
        self._initial_peers = list(dict.fromkeys(peers))
        self._queue_size = queue_size
        self._queue: deque[ReplicaEvent] = deque()
        self._wakeup = asyncio.Event()
        self._peers: set[str] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ReplicaEvent)
        self.bound_endpoint: str | None = None
        self.published = 0
        self.dropped = 0
        self.received = 0
        self.malformed = 0

    async def start(self) -> None:
        for url in self._initial_peers:
            validate_endpoint(url)
        self._ctx = zmq.asyncio.Context()
        try:
            self._open_sockets()
        except BaseException:
            self._close_sockets()
            raise
        self._registry.set_publisher(self.publish)
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="slot-tracker-replica-send"),
            asyncio.create_task(self._recv_loop(), name="slot-tracker-replica-recv"),
        ]

    def _open_sockets(self) -> None:
        assert self._ctx is not None
        # A plain (blocking-API) socket: sends use NOBLOCK and never wait on the loop.
        pub: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.PUB)
        self._pub = pub
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self._bind)
        self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        sub = self._ctx.socket(zmq.SUB)
        self._sub = sub
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        for url in self._initial_peers:
            if url == self._advertise:
                log.warning("not subscribing to %s: it is this replica's advertised endpoint", url)
                continue
            sub.connect(url)
            self._peers.add(url)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def stop(self) -> None:
        self._registry.set_publisher(None)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._close_sockets()

    # ---------------------------------------------------------------- outbound

    def publish(
        self,
        key: TrackerKey,
        block_size: int,
        op: int,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int,
    ) -> None:
        if len(self._queue) >= self._queue_size:
            self.dropped += 1
            return
        self._queue.append(
            ReplicaEvent(
                self.origin,
                key[0],
                key[1],
                block_size,
                op,
                request_id,
                worker_id,
                dp_rank,
                list(sequence_hashes),
                new_isl_tokens,
            )
        )
        if not self._wakeup.is_set():
            self._wakeup.set()

    def pending(self) -> int:
        return len(self._queue)

    async def _send_loop(self) -> None:
        pub = self._pub
        if pub is None:
            raise RuntimeError("replica sync not started")
        queue, encode = self._queue, self._encoder.encode
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while queue:
                event = queue.popleft()
                try:
                    # PUB never blocks: past its high-water mark ZMQ drops for slow peers.
                    pub.send_multipart((TOPIC, encode(event)), flags=zmq.NOBLOCK)
                    self.published += 1
                except zmq.ZMQError as exc:
                    self.dropped += 1
                    log.debug("replica publish failed: %s", exc)

    # ----------------------------------------------------------------- inbound

    async def _recv_loop(self) -> None:
        sub = self._sub
        if sub is None:
            raise RuntimeError("replica sync not started")
        while True:
            frames = await sub.recv_multipart()
            self.handle_message(frames)

    def handle_message(self, frames: Sequence[bytes]) -> bool:
        """Apply one received message; returns whether it changed the registry."""
        if len(frames) != 2 or frames[0] != TOPIC:
            self.malformed += 1
            return False
        try:
            event = self._decoder.decode(frames[1])
        except msgspec.DecodeError:
            self.malformed += 1
            return False
        if event.origin == self.origin:
            return False
        self.received += 1
        return self._registry.apply_replica(
            (event.model_name, event.tenant_id),
            event.block_size,
            event.op,
            event.request_id,
            event.worker_id,
            event.dp_rank,
            event.sequence_hashes,
            event.new_isl_tokens,
        )

    # ------------------------------------------------------------------- peers

    def register_peer(self, url: str) -> bool:
        """Subscribe to a peer's PUB endpoint; True if new, False if already registered.

        Confirms only that the local SUB socket accepted the endpoint, not that the subscription
        handshake has completed (events sent right after may be lost).
        """
        validate_endpoint(url)
        if url == self._advertise:
            raise PeerError("peer endpoint matches this replica's advertised endpoint")
        if url in self._peers:
            return False
        if self._sub is None:
            raise PeerError("replica sync is not running", 503)
        try:
            self._sub.connect(url)
        except zmq.ZMQError as exc:
            raise PeerError(f"failed to register replica peer {url!r}: {exc}") from exc
        self._peers.add(url)
        return True

    def deregister_peer(self, url: str) -> bool:
        """Unsubscribe from a peer; False if it was not registered."""
        validate_endpoint(url)
        if url not in self._peers:
            return False
        if self._sub is None:
            raise PeerError("replica sync is not running", 503)
        try:
            self._sub.disconnect(url)
        except zmq.ZMQError as exc:
            raise PeerError(f"failed to deregister replica peer {url!r}: {exc}") from exc
        self._peers.discard(url)
        return True

    def peers(self) -> list[str]:
        return sorted(self._peers)

"""Work queue served over the request plane (the one-machine, many-processes shape: no NATS).

A process that *hosts* (``DistributedRuntime.work_queue(name, host=True)``: the frontend, for
the prefill queue it pushes to) keeps the items in an in-process :class:`LocalQueueStore` and
serves every queue of that store on the endpoint ``{namespace}.work_queue.ops`` of its
request-plane server, registered in discovery under its lease. Other processes' handles find
the hosts through discovery and send each operation as one request (a msgpack
:class:`QueueOp`, answered by one :class:`QueueReply`):

* ``push`` goes to the handle's own store when it hosts, else to a live host;
* ``pull`` long-polls the live hosts in turn (slices of at most ``POLL_SLICE_S`` seconds, so a
  host that joins or leaves is noticed and ``close()`` is not held up), so one consumer serves
  every host. A pull that delivers an item stays open after its reply, as the consumer's
  *hold* on that item, until the item is settled: if the consumer dies (its request-plane
  connection drops) or abandons the hold, the host gives the item back at once instead of
  after the redelivery timeout (which stays the last resort, e.g. for a consumer that hangs);
* ``ack`` / ``nack`` go back to the host that delivered the item (the store's semantics apply:
  redelivery after the timeout, late acks complete the item) and end its hold;
* ``depth`` reads the handle's own store when it hosts, else sums the hosts.

With several hosts (several frontends) each keeps its own items, FIFO per host; every consumer
pulls from all of them. The items live in the host's memory: they are lost with the host, as
are the requests waiting on them there. A host answers a pull whose caller went away by giving
the item back at once, so a consumer that leaves strands nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec

from dynamo.runtime.client import EndpointClient
from dynamo.runtime.context import Context
from dynamo.runtime.errors import DynamoError, InvalidArgument, NoInstances
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.work_queue.base import QueueDepth, WorkItem, check_limits
from dynamo.runtime.work_queue.local import LocalQueueStore, LocalWorkQueue

log = logging.getLogger(__name__)

COMPONENT = "work_queue"
ENDPOINT = "ops"
POLL_SLICE_S = 1.0  # longest single long-poll of one host
MULTI_HOST_SLICE_S = 0.05  # per host, when several host items
MAX_HOST_POLL_S = 5.0  # a host never holds a pull longer than this
HOLD_CHECK_S = 1.0  # how often a hold looks for its item's redelivery by timeout
_RETRY_S = 0.1


class QueueOp(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """One operation on the queue ``queue`` of a host (``op``: push, pull, ack, nack, depth).
    The limits travel with every operation: the first opener sets them, others must agree."""

    op: str
    queue: str
    max_depth: int
    redelivery_timeout: float
    payload: bytes = b""
    timeout: float = 0.0
    item_id: int = 0
    deliveries: int = 0


class QueueReply(msgspec.Struct, omit_defaults=True):
    """``item_id`` 0: no item (pull timed out). ``waiting``/``in_flight``: a depth answer."""

    item_id: int = 0
    payload: bytes = b""
    deliveries: int = 0
    waiting: int = 0
    in_flight: int = 0


_op_decoder = msgspec.msgpack.Decoder(QueueOp)
_reply_decoder = msgspec.msgpack.Decoder(QueueReply)
_encoder = msgspec.msgpack.Encoder()


def endpoint_id(namespace: str) -> EndpointId:
    return EndpointId(namespace, COMPONENT, ENDPOINT)


class QueueHost:
    """The queues one process hosts, and their request-plane handler (:meth:`handle`)."""

    def __init__(self) -> None:
        # Ids start at a random point: a consumer of several hosts sees distinct item ids.
        self._store = LocalQueueStore(first_item_id=random.SystemRandom().getrandbits(40) + 1)
        self._queues: dict[str, LocalWorkQueue] = {}
        # The holds of delivered items (queue, item id, deliveries): set when settled.
        self._holds: dict[tuple[str, int, int], asyncio.Event] = {}

    def queue(self, name: str, max_depth: int, redelivery_timeout: float) -> LocalWorkQueue:
        """The hosted queue ``name`` (``ValueError`` when it exists with other limits)."""
        queue = self._queues.get(name)
        if queue is None:
            queue = LocalWorkQueue(
                self._store, name, max_depth=max_depth, redelivery_timeout=redelivery_timeout
            )
            self._queues[name] = queue
        elif (queue.max_depth, queue.redelivery_timeout) != (max_depth, redelivery_timeout):
            raise ValueError(f"work queue {name!r} already exists with other limits")
        return queue

    async def handle(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        """The request-plane handler: one :class:`QueueOp` in, one :class:`QueueReply` out."""
        try:
            op = _op_decoder.decode(body)
            queue = self.queue(op.queue, op.max_depth, op.redelivery_timeout)
        except (msgspec.DecodeError, ValueError) as exc:
            raise InvalidArgument(f"bad work-queue operation: {exc}") from exc
        reply = QueueReply()
        if op.op == "push":
            await queue.push(op.payload)
        elif op.op == "pull":
            item = await _pull_unless_stopped(queue, min(op.timeout, MAX_HOST_POLL_S), ctx)
            if item is not None:
                key = (op.queue, item.item_id, item.deliveries)
                settled = self._holds[key] = asyncio.Event()
                try:
                    yield _encoder.encode(QueueReply(item.item_id, item.payload, item.deliveries))
                    await _hold(queue, item, settled, ctx)
                finally:
                    del self._holds[key]
                    if not settled.is_set():  # the consumer died or let go: give it back now
                        await queue.nack(item)
                return
        elif op.op in ("ack", "nack"):
            item = WorkItem(op.item_id, b"", op.deliveries)
            await (queue.ack(item) if op.op == "ack" else queue.nack(item))
            hold = self._holds.get((op.queue, op.item_id, op.deliveries))
            if hold is not None:
                hold.set()
        elif op.op == "depth":
            depth = await queue.depth()
            reply = QueueReply(waiting=depth.waiting, in_flight=depth.in_flight)
        else:
            raise InvalidArgument(f"unknown work-queue operation {op.op!r}")
        yield _encoder.encode(reply)

    async def close(self) -> None:
        for queue in self._queues.values():
            await queue.close()


async def _hold(
    queue: LocalWorkQueue, item: WorkItem, settled: asyncio.Event, ctx: Context
) -> None:
    """Wait until ``item`` is settled (``settled`` set), redelivered by the store's timeout
    (``settled`` is set then too: the hold is over) or its consumer goes away (``ctx``
    stops: its connection dropped or it abandoned the stream; ``settled`` stays clear)."""
    stopped = asyncio.ensure_future(ctx.stopped())
    done = asyncio.ensure_future(settled.wait())
    try:
        while not settled.is_set() and not ctx.is_stopped():
            await asyncio.wait(
                {stopped, done}, timeout=HOLD_CHECK_S, return_when=asyncio.FIRST_COMPLETED
            )
            if not queue.delivered_now(item):  # acked late, or redelivered by the timeout
                settled.set()
    finally:
        stopped.cancel()
        done.cancel()
        await asyncio.gather(stopped, done, return_exceptions=True)


async def _pull_unless_stopped(
    queue: LocalWorkQueue, timeout: float, ctx: Context
) -> WorkItem | None:
    """Pull, but give up when the caller goes away; an item taken as it left goes back."""
    pull = asyncio.ensure_future(queue.pull(timeout))
    stopped = asyncio.ensure_future(ctx.stopped())
    try:
        await asyncio.wait({pull, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not pull.done():
            pull.cancel()
        await asyncio.gather(pull, stopped, return_exceptions=True)
    item = pull.result() if not pull.cancelled() and pull.exception() is None else None
    if item is not None and ctx.is_stopped():
        await queue.nack(item)
        return None
    return item


class ServedWorkQueue:
    """:class:`~dynamo.runtime.work_queue.base.WorkQueue` over the hosts found in discovery;
    ``host`` (this process's :class:`QueueHost`, or None) makes this handle a host too."""

    def __init__(
        self,
        client: EndpointClient,
        name: str,
        *,
        max_depth: int,
        redelivery_timeout: float,
        host: QueueHost | None = None,
    ) -> None:
        check_limits(max_depth, redelivery_timeout)
        self._client = client
        self._name = name
        self._max_depth = max_depth
        self._redelivery_timeout = redelivery_timeout
        self._local = host.queue(name, max_depth, redelivery_timeout) if host is not None else None
        self._delivered: dict[int, tuple[int, int]] = {}  # item id -> (host, deliveries)
        self._turn = 0
        self._closed = False
        self._pulls: set[Context] = set()  # pulls on their way to a host
        self._holds: dict[int, asyncio.Task[None]] = {}  # item id -> its hold (_pull_from)
        self._no_pulls = asyncio.Event()

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_depth(self) -> int:
        return self._max_depth

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("work queue is closed")

    async def _call(
        self, host: int, op: str, ctx: Context | None = None, **fields: object
    ) -> QueueReply:
        body = _encoder.encode(
            QueueOp(
                op=op,
                queue=self._name,
                max_depth=self._max_depth,
                redelivery_timeout=self._redelivery_timeout,
                **fields,  # type: ignore[arg-type]
            )
        )
        reply = QueueReply()
        async for raw in self._client.stream(body, ctx or Context(), instance_id=host):
            reply = _reply_decoder.decode(raw)
        return reply

    def _hosts(self) -> list[int]:
        hosts = self._client.instance_ids()
        if not hosts:
            raise NoInstances(f"no process hosts work queue {self._name!r}")
        return hosts

    async def push(self, payload: bytes) -> None:
        if self._closed:
            raise RuntimeError("work queue is closed")
        if self._local is not None:
            await self._local.push(payload)
            return
        await self._call(random.choice(self._hosts()), "push", payload=payload)

    async def pull(self, timeout: float | None = None) -> WorkItem | None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._closed:
            remaining = POLL_SLICE_S if deadline is None else deadline - loop.time()
            if remaining < 0:
                return None
            hosts = self._client.instance_ids()
            if not hosts:
                await asyncio.sleep(min(_RETRY_S, remaining))
                continue
            self._turn += 1
            host = hosts[self._turn % len(hosts)]
            slice_s = POLL_SLICE_S if len(hosts) == 1 else MULTI_HOST_SLICE_S
            ctx = Context()
            self._pulls.add(ctx)
            try:
                reply, hold = await self._pull_from(host, ctx, min(remaining, slice_s))
            except DynamoError as exc:  # a host went away (or close() stopped us)
                if self._closed:
                    return None
                log.debug("work queue %s: pull from %x failed: %s", self._name, host, exc)
                await asyncio.sleep(min(_RETRY_S, max(remaining, 0.0)))
                continue
            finally:
                self._pulls.discard(ctx)
                if not self._pulls:
                    self._no_pulls.set()
            if reply.item_id == 0:
                if deadline is not None and loop.time() >= deadline:
                    return None
                continue
            item = WorkItem(reply.item_id, reply.payload, reply.deliveries)
            if self._closed:  # closed while the pull was on its way: give it back
                with contextlib.suppress(DynamoError):
                    await self._call(host, "nack", item_id=item.item_id, deliveries=item.deliveries)
                await _let_go(hold)
                return None
            self._delivered[item.item_id] = (host, item.deliveries)
            if hold is not None:
                self._holds[item.item_id] = hold
            return item
        return None

    async def _pull_from(
        self, host: int, ctx: Context, timeout: float
    ) -> tuple[QueueReply, asyncio.Task[None] | None]:
        """One long-poll of ``host``. With an item, the stream stays open as this process's
        hold on it (see the module docstring): the returned task keeps reading it until the
        host ends it (the item settled); cancelling the task lets go of the item."""
        body = _encoder.encode(
            QueueOp(
                op="pull",
                queue=self._name,
                max_depth=self._max_depth,
                redelivery_timeout=self._redelivery_timeout,
                timeout=timeout,
            )
        )
        stream = self._client.stream(body, ctx, instance_id=host)
        try:
            reply = _reply_decoder.decode(await anext(stream))
        except StopAsyncIteration:
            return QueueReply(), None
        except BaseException:
            await stream.aclose()
            raise
        if reply.item_id == 0:
            await stream.aclose()
            return reply, None
        return reply, asyncio.create_task(_drain(stream), name=f"work-queue-hold:{self._name}")

    async def _settle(self, op: str, item: WorkItem) -> None:
        delivered = self._delivered.pop(item.item_id, None)
        hold = self._holds.pop(item.item_id, None)
        if delivered is None:
            await _let_go(hold)
            return
        host, _ = delivered
        try:
            await self._call(host, op, item_id=item.item_id, deliveries=item.deliveries)
        finally:
            # Let go only after the host has the settlement: letting go first would give the
            # item back (and a finished item would be delivered again).
            await _let_go(hold)

    async def ack(self, item: WorkItem) -> None:
        await self._settle("ack", item)

    async def nack(self, item: WorkItem) -> None:
        await self._settle("nack", item)

    async def depth(self) -> QueueDepth:
        if self._local is not None:
            return await self._local.depth()
        waiting = in_flight = 0
        for host in self._hosts():
            reply = await self._call(host, "depth")
            waiting += reply.waiting
            in_flight += reply.in_flight
        return QueueDepth(waiting, in_flight)

    async def close(self) -> None:
        """Give back the items this handle holds unsettled (best effort: a host that cannot be
        reached redelivers them after its timeout)."""
        if self._closed:
            return
        self._closed = True
        # Stop the pulls on their way first (the host gives back what it takes as they stop),
        # so the items given back below are not handed straight to this handle again.
        if self._pulls:
            self._no_pulls.clear()
            for ctx in list(self._pulls):
                ctx.stop_generating()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._no_pulls.wait(), POLL_SLICE_S + 1.0)
        for item_id, (host, deliveries) in list(self._delivered.items()):
            with contextlib.suppress(DynamoError):
                await self._call(host, "nack", item_id=item_id, deliveries=deliveries)
        self._delivered.clear()
        for hold in list(self._holds.values()):
            await _let_go(hold)
        self._holds.clear()


async def _drain(stream: AsyncGenerator[bytes, None]) -> None:
    """Keep a hold's stream open until the host ends it; a failure ends the hold (the host
    sees the stream go and gives the item back)."""
    try:
        async for _ in stream:
            pass
    except DynamoError as exc:
        log.debug("work queue hold ended: %s", exc)
    finally:
        await stream.aclose()


async def _let_go(hold: asyncio.Task[None] | None) -> None:
    """End a hold: the host's end of it gives its item back if it is still unsettled."""
    if hold is None:
        return
    hold.cancel()
    await asyncio.gather(hold, return_exceptions=True)

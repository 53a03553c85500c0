"""Work queue on a NATS JetStream work-queue stream (the many-machines shape).

Layout: the stream ``DYN_WQ_<name>`` holds subject ``dyn.wq.<name>`` with work-queue retention
(a message is deleted once acknowledged), ``max_msgs = max_depth`` and ``discard = new`` (a push
to a full stream is refused: ``Overloaded``). Every handle pulls through one shared durable
consumer ``workers`` with explicit acks and ``ack_wait = redelivery_timeout``, so JetStream
itself redelivers what a dead or hung consumer left unacknowledged. The stream is file-backed:
queued work survives a NATS restart.
"""

from __future__ import annotations

import asyncio
import logging
import re

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from dynamo.runtime.errors import CannotConnect, Overloaded
from dynamo.runtime.work_queue.base import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_REDELIVERY_TIMEOUT,
    QueueDepth,
    WorkItem,
    check_limits,
)

log = logging.getLogger(__name__)

CONSUMER = "workers"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_FETCH_SLICE = 1.0  # a pull without timeout fetches in slices so close() is noticed


def stream_name(queue_name: str) -> str:
    return "DYN_WQ_" + _UNSAFE.sub("_", queue_name)


class JetStreamWorkQueue:
    """:class:`~dynamo.runtime.work_queue.base.WorkQueue` on a JetStream stream, over a NATS
    connection it does not own. ``close()`` gives back (naks) the items this handle delivered
    and that are still unsettled."""

    def __init__(
        self,
        client: Client,
        name: str,
        *,
        max_depth: int = DEFAULT_MAX_DEPTH,
        redelivery_timeout: float = DEFAULT_REDELIVERY_TIMEOUT,
    ) -> None:
        check_limits(max_depth, redelivery_timeout)
        self._client = client
        self._js = client.jetstream()
        self._name = name
        self._stream = stream_name(name)
        self._subject = "dyn.wq." + _UNSAFE.sub("_", name)
        self._max_depth = max_depth
        self._redelivery_timeout = redelivery_timeout
        self._pull: nats.js.JetStreamContext.PullSubscription | None = None
        self._delivered: dict[int, Msg] = {}  # stream seq -> message, until settled
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_depth(self) -> int:
        return self._max_depth

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("work queue is closed")
        config = api.StreamConfig(
            name=self._stream,
            subjects=[self._subject],
            retention=api.RetentionPolicy.WORK_QUEUE,
            max_msgs=self._max_depth,
            discard=api.DiscardPolicy.NEW,
            storage=api.StorageType.FILE,
        )
        try:
            await self._js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            raise ValueError(f"work queue {self._name!r} exists with other limits: {exc}") from exc
        except nats.errors.Error as exc:
            raise CannotConnect(f"JetStream unavailable: {exc}") from exc
        consumer = api.ConsumerConfig(
            durable_name=CONSUMER,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self._redelivery_timeout,
            max_deliver=-1,
            max_ack_pending=-1,
        )
        self._pull = await self._js.pull_subscribe(
            self._subject, durable=CONSUMER, stream=self._stream, config=consumer
        )

    async def push(self, payload: bytes) -> None:
        if self._closed:
            raise RuntimeError("work queue is closed")
        try:
            await self._js.publish(self._subject, payload, stream=self._stream)
        except nats.js.errors.APIError as exc:
            if exc.err_code == 10077:  # JSStreamStoreFailedF: maximum messages exceeded
                raise Overloaded(
                    f"work queue {self._name!r} is full ({self._max_depth} items)"
                ) from exc
            raise CannotConnect(f"JetStream refused the push: {exc}") from exc
        except nats.errors.Error as exc:
            raise CannotConnect(f"JetStream unavailable: {exc}") from exc

    async def pull(self, timeout: float | None = None) -> WorkItem | None:
        assert self._pull is not None, "start() first"
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._closed:
            remaining = _FETCH_SLICE if deadline is None else deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                msgs = await self._pull.fetch(1, timeout=min(remaining, _FETCH_SLICE))
            except nats.errors.TimeoutError:
                continue
            except nats.errors.Error as exc:
                if self._closed:
                    return None
                log.warning("work queue %s: fetch failed (%s); retrying", self._name, exc)
                await asyncio.sleep(0.1)
                continue
            if msgs:
                return self._deliver(msgs[0])
        return None

    def _deliver(self, msg: Msg) -> WorkItem:
        meta = msg.metadata
        item_id = int(meta.sequence.stream)
        self._delivered[item_id] = msg
        return WorkItem(item_id, msg.data, int(meta.num_delivered))

    async def ack(self, item: WorkItem) -> None:
        msg = self._delivered.pop(item.item_id, None)
        if msg is not None:
            await msg.ack_sync()  # confirmed: the room it frees is visible at once

    async def nack(self, item: WorkItem) -> None:
        msg = self._delivered.pop(item.item_id, None)
        if msg is not None:
            await msg.nak()
            await self._client.flush()  # processed before this handle's next fetch

    async def depth(self) -> QueueDepth:
        try:
            stream = await self._js.stream_info(self._stream)
            consumer = await self._js.consumer_info(self._stream, CONSUMER)
        except nats.errors.Error as exc:
            raise CannotConnect(f"JetStream unavailable: {exc}") from exc
        total = int(stream.state.messages)
        in_flight = min(total, int(consumer.num_ack_pending))
        return QueueDepth(waiting=total - in_flight, in_flight=in_flight)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for msg in self._delivered.values():
            try:
                await msg.nak()
            except nats.errors.Error:
                break  # connection gone: JetStream redelivers after ack_wait anyway
        self._delivered.clear()
        if self._pull is not None:
            try:
                await self._pull.unsubscribe()
            except nats.errors.Error:
                pass

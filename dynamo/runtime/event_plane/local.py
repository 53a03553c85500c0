"""In-process event plane: a shared :class:`LocalEventBus` and per-"process" planes on it.

Delivery is synchronous fan-out into bounded per-subscriber queues; a full queue drops the new
message (counted in ``dropped``) and never blocks the publisher, like ZMQ PUB at its HWM.
"""

from __future__ import annotations

import asyncio
from collections import deque

from dynamo.runtime.event_plane.base import EventMessage
from dynamo.runtime.naming import new_instance_id

DEFAULT_MAX_QUEUE = 10_000


class LocalSubscription:
    """Messages whose topic starts with ``prefix``, from every plane on the bus.

    Iteration stops once the subscription (or its plane) is closed. ``dropped`` counts messages
    lost because this subscriber's queue was full; the receiver also sees the gap in ``seq``.
    """

    def __init__(self, bus: LocalEventBus, prefix: str, max_queue: int) -> None:
        self.prefix = prefix
        self.dropped = 0
        self._bus = bus
        self._max_queue = max_queue
        self._items: deque[EventMessage] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def offer(self, message: EventMessage) -> None:
        """Enqueue without blocking (called by the bus on the publisher's stack)."""
        if len(self._items) >= self._max_queue:
            self.dropped += 1
            return
        self._items.append(message)
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> LocalSubscription:
        return self

    async def __anext__(self) -> EventMessage:
        while not self._items:
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._closed:
            raise StopAsyncIteration
        return self._items.popleft()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._items.clear()
        self._bus.unsubscribe(self)
        self._wake()


class LocalEventBus:
    """The shared state of in-process planes: the live subscriptions."""

    def __init__(self) -> None:
        self._subscriptions: list[LocalSubscription] = []

    def subscribe(self, prefix: str, max_queue: int) -> LocalSubscription:
        subscription = LocalSubscription(self, prefix, max_queue)
        self._subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: LocalSubscription) -> None:
        if subscription in self._subscriptions:
            self._subscriptions.remove(subscription)

    def deliver(self, message: EventMessage) -> None:
        topic = message.topic
        for subscription in self._subscriptions:
            if topic.startswith(subscription.prefix):
                subscription.offer(message)


class LocalEventPlane:
    """:class:`EventPlane` on a :class:`LocalEventBus`: one publisher id, ``seq`` per topic from 0.

    ``max_queue`` bounds each of this plane's subscriptions. ``close()`` closes them.
    """

    def __init__(self, bus: LocalEventBus, *, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        if max_queue <= 0:
            raise ValueError("max_queue must be positive")
        self._bus = bus
        self._max_queue = max_queue
        self._publisher_id = new_instance_id()
        self._seqs: dict[str, int] = {}
        self._subscriptions: list[LocalSubscription] = []
        self._closed = False

    @property
    def publisher_id(self) -> int:
        return self._publisher_id

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("event plane is closed")

    async def publish(self, topic: str, payload: bytes) -> None:
        if self._closed:
            raise RuntimeError("event plane is closed")
        seq = self._seqs.get(topic, 0)
        self._seqs[topic] = seq + 1
        self._bus.deliver(EventMessage(topic, self._publisher_id, seq, payload))

    async def subscribe(self, topic_prefix: str) -> LocalSubscription:
        if self._closed:
            raise RuntimeError("event plane is closed")
        subscription = self._bus.subscribe(topic_prefix, self._max_queue)
        self._subscriptions = [s for s in self._subscriptions if not s.closed]
        self._subscriptions.append(subscription)
        return subscription

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for subscription in self._subscriptions:
            await subscription.close()
        self._subscriptions.clear()

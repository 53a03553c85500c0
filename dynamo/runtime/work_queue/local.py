"""In-process work queue: a shared :class:`LocalQueueStore` and per-"process" handles on it.

Several :class:`LocalWorkQueue` handles over one store behave like several processes over one
JetStream work-queue stream (``dynamo serve --in-process``, integration tests). Everything runs
on the event loop thread; redelivery is a loop timer per delivery.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from dynamo.runtime.errors import Overloaded
from dynamo.runtime.work_queue.base import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_REDELIVERY_TIMEOUT,
    QueueDepth,
    WorkItem,
    check_limits,
)


@dataclass(slots=True)
class _Stored:
    payload: bytes
    deliveries: int = 0
    # Set while in flight: the timer that puts the item back if it is not settled in time.
    redelivery: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _QueueState:
    """One named queue. ``waiting`` holds ids in delivery order; ``stored`` every unacked item."""

    max_depth: int
    redelivery_timeout: float
    next_id: int = 1
    waiting: deque[int] = field(default_factory=deque)
    stored: dict[int, _Stored] = field(default_factory=dict)
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def wake_all(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def requeue(self, item_id: int) -> None:
        """Back to the head of the line (it is older than anything waiting)."""
        stored = self.stored[item_id]
        if stored.redelivery is not None:
            stored.redelivery.cancel()
            stored.redelivery = None
        self.waiting.appendleft(item_id)
        self.wake_one()

    def expire(self, item_id: int, deliveries: int) -> None:
        stored = self.stored.get(item_id)
        if stored is not None and stored.redelivery is not None and stored.deliveries == deliveries:
            self.requeue(item_id)

    def settle_target(self, item: WorkItem) -> _Stored | None:
        """The stored item if ``item`` is its current, unsettled delivery."""
        stored = self.stored.get(item.item_id)
        if stored is None or stored.redelivery is None or stored.deliveries != item.deliveries:
            return None
        return stored


class LocalQueueStore:
    """The shared state of in-process queues, by name. The first handle to open a name sets its
    limits; later handles must agree (as they would have to on a JetStream stream)."""

    def __init__(self, first_item_id: int = 1) -> None:
        """``first_item_id``: where item ids start (a store served to other processes starts
        at a random point, so that a consumer pulling from several stores sees distinct ids)."""
        self._queues: dict[str, _QueueState] = {}
        self._first_item_id = first_item_id

    def open(self, name: str, max_depth: int, redelivery_timeout: float) -> _QueueState:
        state = self._queues.get(name)
        if state is None:
            state = _QueueState(max_depth, redelivery_timeout, next_id=self._first_item_id)
            self._queues[name] = state
        elif (state.max_depth, state.redelivery_timeout) != (max_depth, redelivery_timeout):
            raise ValueError(f"work queue {name!r} already exists with other limits")
        return state


class LocalWorkQueue:
    """:class:`~dynamo.runtime.work_queue.base.WorkQueue` on a :class:`LocalQueueStore`.

    ``close()`` wakes this handle's pending pulls and gives back (nacks) the items it delivered
    and that are still unsettled, so a consumer that leaves does not hold work for the whole
    redelivery timeout.
    """

    def __init__(
        self,
        store: LocalQueueStore,
        name: str,
        *,
        max_depth: int = DEFAULT_MAX_DEPTH,
        redelivery_timeout: float = DEFAULT_REDELIVERY_TIMEOUT,
    ) -> None:
        check_limits(max_depth, redelivery_timeout)
        self._name = name
        self._state = store.open(name, max_depth, redelivery_timeout)
        self._delivered: dict[int, int] = {}  # item id -> deliveries, for close()
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_depth(self) -> int:
        return self._state.max_depth

    @property
    def redelivery_timeout(self) -> float:
        return self._state.redelivery_timeout

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("work queue is closed")

    async def push(self, payload: bytes) -> None:
        if self._closed:
            raise RuntimeError("work queue is closed")
        state = self._state
        if len(state.stored) >= state.max_depth:
            raise Overloaded(f"work queue {self._name!r} is full ({state.max_depth} items)")
        item_id = state.next_id
        state.next_id += 1
        state.stored[item_id] = _Stored(payload)
        state.waiting.append(item_id)
        state.wake_one()

    async def pull(self, timeout: float | None = None) -> WorkItem | None:
        state = self._state
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._closed:
            if state.waiting:
                return self._deliver(state.waiting.popleft())
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            waiter: asyncio.Future[None] = loop.create_future()
            state.waiters.append(waiter)
            woken = False
            try:
                await asyncio.wait({waiter}, timeout=remaining)
                woken = waiter.done()
            finally:
                if not waiter.done():
                    waiter.cancel()
                elif not woken and state.waiting:
                    # Cancelled right after a wake meant for us: pass it on.
                    state.wake_one()
        return None

    def _deliver(self, item_id: int) -> WorkItem:
        state = self._state
        stored = state.stored[item_id]
        stored.deliveries += 1
        stored.redelivery = asyncio.get_running_loop().call_later(
            state.redelivery_timeout, state.expire, item_id, stored.deliveries
        )
        self._delivered[item_id] = stored.deliveries
        return WorkItem(item_id, stored.payload, stored.deliveries)

    def delivered_now(self, item: WorkItem) -> bool:
        """Whether ``item`` is its item's current, unsettled delivery."""
        return self._state.settle_target(item) is not None

    async def ack(self, item: WorkItem) -> None:
        self._delivered.pop(item.item_id, None)
        state = self._state
        stored = state.stored.pop(item.item_id, None)
        if stored is None:
            return
        if stored.redelivery is not None:
            stored.redelivery.cancel()
        else:  # a late ack while it waits for redelivery
            state.waiting.remove(item.item_id)
        # Room freed; producers do not wait (push fails fast), consumers need no wake.

    async def nack(self, item: WorkItem) -> None:
        self._delivered.pop(item.item_id, None)
        if self._state.settle_target(item) is not None:
            self._state.requeue(item.item_id)

    async def depth(self) -> QueueDepth:
        state = self._state
        return QueueDepth(
            waiting=len(state.waiting), in_flight=len(state.stored) - len(state.waiting)
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for item_id, deliveries in list(self._delivered.items()):
            await self.nack(WorkItem(item_id, b"", deliveries))
        self._delivered.clear()
        # Wake every pull: ours return None, the others go back to waiting.
        self._state.wake_all()

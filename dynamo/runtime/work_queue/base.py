"""The work-queue contract (the global prefill queue of disaggregation, spec 003).

* ``push(payload)`` appends an item. The queue is bounded: when ``max_depth`` items are not yet
  acknowledged (waiting or in flight), ``push`` raises :class:`~dynamo.runtime.errors.Overloaded`
  and the item is not stored.
* ``pull(timeout)`` hands the oldest waiting item to exactly one consumer, or returns ``None``
  after ``timeout`` seconds (``None``: wait until an item or ``close()``).
* The consumer settles every pulled item: ``ack`` removes it for good; ``nack`` puts it back at
  once. An item neither acked nor nacked within ``redelivery_timeout`` seconds of its delivery
  (its consumer died or hangs) becomes waiting again and is delivered again, with
  ``deliveries`` counting the attempts. Delivery is therefore *at least once*: consumers must
  tolerate a redelivered item. A late ack from an earlier delivery still completes the item (the
  work was done; JetStream behaves so): the later delivery's ack is then a no-op.
* ``depth()`` reads how many items wait and how many are in flight.

Backends: ``local`` (one process, :mod:`dynamo.runtime.work_queue.local`) and ``jetstream``
(a NATS JetStream work-queue stream shared by many hosts). Callers only see this interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

DEFAULT_MAX_DEPTH = 1024
DEFAULT_REDELIVERY_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One delivery of an item. ``item_id`` is unique within its queue; ``deliveries`` is 1 on
    the first delivery and grows with each redelivery."""

    item_id: int
    payload: bytes
    deliveries: int


@dataclass(frozen=True, slots=True)
class QueueDepth:
    waiting: int
    in_flight: int

    @property
    def total(self) -> int:
        """Items stored (not yet acknowledged): what ``max_depth`` bounds."""
        return self.waiting + self.in_flight


class WorkQueue(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def max_depth(self) -> int: ...

    async def start(self) -> None: ...

    async def push(self, payload: bytes) -> None:
        """Store ``payload``; raise ``Overloaded`` when ``max_depth`` items are stored."""
        ...

    async def pull(self, timeout: float | None = None) -> WorkItem | None:
        """The oldest waiting item, delivered to this caller only; ``None`` on timeout/close."""
        ...

    async def ack(self, item: WorkItem) -> None:
        """Done with ``item``: remove it (also from a later delivery's consumer)."""
        ...

    async def nack(self, item: WorkItem) -> None:
        """Give ``item`` back for redelivery now, not after the timeout (ignored if redelivered
        since); other waiting items may still be delivered before it."""
        ...

    async def depth(self) -> QueueDepth: ...

    async def close(self) -> None:
        """Wake pending ``pull`` calls (they return ``None``); idempotent."""
        ...


def check_limits(max_depth: int, redelivery_timeout: float) -> None:
    if max_depth <= 0:
        raise ValueError("work queue max_depth must be positive")
    if redelivery_timeout <= 0:
        raise ValueError("work queue redelivery_timeout must be positive")

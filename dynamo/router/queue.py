"""The router queue (FACTS §4.5): requests held until a worker has prefill capacity.

With ``--router-queue-threshold t`` a request is *held* while every eligible worker rank has
``active_prefill_tokens > t * max_num_batched_tokens``, and is routed only when capacity frees (a
request's prefill completes, a request ends, a worker joins), so its routing decision reads the
load as it is then, not as it was when the request arrived.

Held requests are served in the order of ``(strict_priority, policy_key)``, largest first: a
higher strict tier always goes before a lower one; within a tier the policy's key decides, and
equal keys go in arrival order.

* ``fcfs`` (default): ``priority_jump - arrival_offset`` (a priority bump acts as an earlier
  arrival by that many seconds; tail TTFT).
* ``wspt``: ``(1 + priority_jump) / max(1, isl - cached_tokens)`` (Smith's rule, weighted
  shortest processing time first; mean TTFT).
* ``lcfs``: ``priority_jump + arrival_offset`` (latest first; for experiments).

:class:`PendingQueue` is the ordering and nothing else: synchronous, no asyncio, an injectable
clock, so the live KV router (``router/kv_router.py``, which resolves futures) and the offline
replay (``replay/simulator.py``, on its virtual clock) hold and release with the same code. One
owner calls every method.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dynamo.runtime.errors import Overloaded

T = TypeVar("T")

DEFAULT_POLICY_CLASS = "default"
"""The ``policy_class`` label of the one queue a router has (the reference's synthetic class
when no policy configuration is given)."""


class QueuePolicy(enum.Enum):
    FCFS = "fcfs"
    WSPT = "wspt"
    LCFS = "lcfs"


class QueueFull(Overloaded):
    """The queue holds ``max_requests`` already: the request is refused (HTTP 529)."""


def policy_key(
    policy: QueuePolicy,
    *,
    priority_jump: float,
    arrival_offset: float,
    isl: int,
    cached_tokens: int,
) -> float:
    """The key of one request under ``policy`` (larger is served first)."""
    if policy is QueuePolicy.FCFS:
        return priority_jump - arrival_offset
    if policy is QueuePolicy.WSPT:
        return (1.0 + priority_jump) / max(1, isl - cached_tokens)
    return priority_jump + arrival_offset


@dataclass(slots=True, eq=False)
class Held(Generic[T]):
    """One held request: its payload and its place in the order."""

    item: T
    strict_priority: int
    key: float
    seq: int
    queued_at: float
    isl: int = 0
    cached_tokens: int = 0
    waiting: bool = field(default=True)


class PendingQueue(Generic[T]):
    """Held requests, largest ``(strict_priority, key)`` first, arrival order among equals.

    ``push`` refuses a request past ``max_requests`` (:class:`QueueFull`); ``discard`` takes a
    held request out (cancelled, timed out) in O(1) (the heap entry is skipped later);
    ``drain`` releases requests from the front while ``ready`` says the front one may go.
    """

    def __init__(
        self,
        policy: QueuePolicy = QueuePolicy.FCFS,
        max_requests: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_requests is not None and max_requests < 1:
            raise ValueError("the router queue's max_requests must be at least 1")
        self.policy = policy
        self.max_requests = max_requests
        self._clock = clock
        self._origin = clock()
        self._heap: list[tuple[int, float, int, Held[T]]] = []
        self._seq = itertools.count()
        self._waiting = 0
        self.isl_tokens = 0
        """Prompt tokens of the held requests (``router_queue_pending_isl_tokens``)."""
        self.cached_tokens = 0
        """Their predicted cached tokens at arrival (``router_queue_pending_cached_tokens``)."""
        self.rejected = 0
        """Requests refused because the queue was full (since start)."""

    def __len__(self) -> int:
        return self._waiting

    def push(
        self,
        item: T,
        *,
        priority_jump: float = 0.0,
        strict_priority: int = 0,
        isl: int = 0,
        cached_tokens: int = 0,
    ) -> Held[T]:
        """Hold ``item``. Raises :class:`QueueFull` when ``max_requests`` are held already."""
        if self.max_requests is not None and self._waiting >= self.max_requests:
            self.rejected += 1
            raise QueueFull(
                f"the router queue is full ({self._waiting} requests waiting for capacity); "
                "retry later"
            )
        now = self._clock()
        key = policy_key(
            self.policy,
            priority_jump=priority_jump,
            arrival_offset=now - self._origin,
            isl=isl,
            cached_tokens=cached_tokens,
        )
        held = Held(item, strict_priority, key, next(self._seq), now, isl, cached_tokens)
        heapq.heappush(self._heap, (-strict_priority, -key, held.seq, held))
        self._waiting += 1
        self.isl_tokens += isl
        self.cached_tokens += cached_tokens
        return held

    def peek(self) -> Held[T] | None:
        """The request that goes next (None: nothing is held)."""
        heap = self._heap
        while heap and not heap[0][3].waiting:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self) -> Held[T]:
        """Take the front request out (``IndexError`` when nothing is held)."""
        held = self.peek()
        if held is None:
            raise IndexError("pop from an empty router queue")
        heapq.heappop(self._heap)
        self._leave(held)
        return held

    def discard(self, held: Held[T]) -> bool:
        """Take ``held`` out wherever it is; False if it already left (released, discarded)."""
        if not held.waiting:
            return False
        self._leave(held)
        if not self._waiting:
            self._heap.clear()  # nothing waits: drop the skipped entries now
        return True

    def drain(self, ready: Callable[[Held[T]], bool], release: Callable[[Held[T]], None]) -> int:
        """Release front requests, in order, while ``ready(front)``: each is taken out, then
        handed to ``release`` (which routes it, so the next ``ready`` sees its load). Stops at
        the first front request that is not ready, even if a later one could go (head-of-line,
        as the reference's ``SchedulerQueue::update``). Returns how many were released."""
        released = 0
        while (held := self.peek()) is not None and ready(held):
            self.pop()
            release(held)
            released += 1
        return released

    def items(self) -> list[T]:
        """The held payloads, in the order they would be released."""
        entries = sorted(e for e in self._heap if e[3].waiting)
        return [e[3].item for e in entries]

    def _leave(self, held: Held[T]) -> None:
        held.waiting = False
        self._waiting -= 1
        self.isl_tokens -= held.isl
        self.cached_tokens -= held.cached_tokens

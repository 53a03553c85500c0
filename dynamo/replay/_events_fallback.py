"""Pure-Python twin of ``dynamo.replay._events`` (contract: ``_events.pyi``) over heapq, used
where the extension is not built or ``DYN_NATIVE=0``."""

from __future__ import annotations

import heapq
import math
from operator import index
from typing import Any


class EventQueue:
    """The replay's pending events by ``(when, kind, order)`` (see ``_events.pyi``)."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []

    def push(self, when: float, kind: int, order: int, payload: Any) -> None:
        if math.isnan(when):  # TypeError for a non-number, as the native float conversion
            raise ValueError("an event's time must not be NaN")
        heapq.heappush(self._heap, (float(when), index(kind), index(order), payload))

    def pop(self) -> tuple[float, int, Any]:
        if not self._heap:
            raise IndexError("pop from an empty event queue")
        when, kind, _, payload = heapq.heappop(self._heap)
        return when, kind, payload

    def next_when(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def __len__(self) -> int:
        return len(self._heap)

"""Type stub of the native module ``dynamo.replay._events`` (source: ``_events.c``; the same
contract over heapq: ``_events_fallback.py``). Import through ``dynamo.replay.events``."""

from typing import Any

class EventQueue:
    """The replay's pending events, first out first: ordered by ``when``, then ``kind``, then
    ``order`` (the caller's FIFO counter; entries equal in all three come out in no promised
    order). ``len()`` is the number queued."""

    def push(self, when: float, kind: int, order: int, payload: Any) -> None:
        """Queue an event (ValueError for a NaN time; kind and order are 64-bit ints)."""
    def pop(self) -> tuple[float, int, Any]:
        """The first event's ``(when, kind, payload)``, removed; IndexError when empty."""
    def next_when(self) -> float:
        """The first event's time, ``inf`` when empty."""
    def __len__(self) -> int: ...

"""The replay's event queue: the native heap (``_events.c``) or its heapq twin
(``_events_fallback.py``), chosen once by ``dynamo.native`` (``DYN_NATIVE``); the contract of
both is ``_events.pyi``. Import ``EventQueue`` from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load(
    "dynamo.replay._events", "dynamo.replay._events_fallback", requires=("EventQueue",)
)
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.replay._events`` or ``dynamo.replay._events_fallback``)."""

if TYPE_CHECKING:
    from dynamo.replay._events import EventQueue
else:
    EventQueue = _impl.EventQueue

__all__ = ["IMPLEMENTATION", "EventQueue"]

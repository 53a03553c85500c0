"""The event-plane contract.

A publisher sends ``payload`` bytes on a ``topic``. Every publisher has a unique ``publisher_id``
and numbers its messages per topic from 0 (``seq``), so a receiver can detect gaps (lost
messages). Delivery is best-effort, ordered per publisher and topic. A subscription receives the
messages of every publisher in the namespace whose topic starts with the subscribed prefix,
including publishers that appear after it subscribed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

import msgspec


class EventMessage(msgspec.Struct, frozen=True, gc=False):
    topic: str
    publisher_id: int
    seq: int
    payload: bytes


class Subscription(Protocol):
    def __aiter__(self) -> AsyncIterator[EventMessage]: ...

    async def close(self) -> None: ...


class EventPlane(Protocol):
    @property
    def publisher_id(self) -> int: ...

    async def start(self) -> None: ...

    async def publish(self, topic: str, payload: bytes) -> None:
        """Publish without waiting for subscribers; never blocks on a slow receiver."""
        ...

    async def subscribe(self, topic_prefix: str) -> Subscription: ...

    async def close(self) -> None: ...


@runtime_checkable
class StoredEventPlane(Protocol):
    """An event plane that also keeps some topics' messages (NATS JetStream): a receiver that
    starts late reads what was published before it subscribed instead of asking every
    publisher for its state."""

    def replay(self, topic: str) -> AsyncIterator[EventMessage]:
        """The stored messages of ``topic``, oldest first, up to those stored when called
        (retention may have dropped the oldest: receivers see that as a seq/id gap)."""
        ...

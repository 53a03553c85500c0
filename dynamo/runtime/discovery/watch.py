"""The Watch that discovery backends feed: a fixed snapshot, then events in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dynamo.runtime.discovery.base import KeyValue, WatchEvent


class QueueWatch:
    """A Watch fed by its backend: a fixed snapshot, then events pushed in order.

    The backend calls :meth:`push` (never blocks: the queue is unbounded, watch traffic is small)
    and :meth:`end` when it shuts down; iteration then stops. ``close()`` is the consumer's side.
    """

    OnClose = Callable[["QueueWatch"], None]

    def __init__(
        self,
        prefix: str,
        snapshot: list[KeyValue],
        on_close: Callable[[QueueWatch], None],
    ) -> None:
        self.prefix = prefix
        self._snapshot = snapshot
        self._on_close = on_close
        self._queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self._ended = False
        self._finished = False

    @property
    def snapshot(self) -> list[KeyValue]:
        return self._snapshot

    def push(self, event: WatchEvent) -> None:
        if not self._ended:
            self._queue.put_nowait(event)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._queue.put_nowait(None)

    async def close(self) -> None:
        if not self._ended:
            self.end()
            self._on_close(self)

    def __aiter__(self) -> QueueWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is None:
            self._finished = True
            raise StopAsyncIteration
        return event

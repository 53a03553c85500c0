"""Following a discovery prefix: the snapshot, then every change, in order, until closed.

Every component that mirrors part of discovery (the endpoint client's instances, the frontend's
model cards, the run-time disaggregation thresholds) does the same four things: watch the prefix,
apply its snapshot, apply each later event in order on one task, and close both. This is that,
once. A handler that raises is logged and the follower goes on: one malformed record must not
stop a process from seeing every later change.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

from dynamo.runtime.discovery.base import Discovery, Watch, WatchEventKind

log = logging.getLogger(__name__)

OnPut = Callable[[str, bytes], Awaitable[None] | None]
OnDelete = Callable[[str], Awaitable[None] | None]


class PrefixFollower:
    """Applies ``prefix``'s keys through ``on_put(key, value)`` / ``on_delete(key)``.

    :meth:`start` returns once the snapshot is applied (each key as a put); the events after it
    are applied by one task, in order, each handler awaited before the next event (handlers
    may be plain functions or coroutines). :meth:`close` (idempotent) stops the task and the
    watch; after it no handler runs. Single-loop use.
    """

    def __init__(
        self,
        discovery: Discovery,
        prefix: str,
        on_put: OnPut,
        on_delete: OnDelete,
        *,
        name: str = "",
    ) -> None:
        self.prefix = prefix
        self._discovery = discovery
        self._on_put = on_put
        self._on_delete = on_delete
        self._name = name or f"follow:{prefix}"
        self._watch: Watch | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._watch is not None:
            raise RuntimeError(f"{self._name} already started")
        self._watch = await self._discovery.watch_prefix(self.prefix)
        for kv in self._watch.snapshot:
            await self._apply(WatchEventKind.PUT, kv.key, kv.value)
        self._task = asyncio.create_task(self._follow(self._watch), name=self._name)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watch, self._watch = self._watch, None
        if watch is not None:
            await watch.close()

    async def _follow(self, watch: Watch) -> None:
        async for event in watch:
            await self._apply(event.kind, event.key, event.value)

    async def _apply(self, kind: WatchEventKind, key: str, value: bytes) -> None:
        try:
            if kind is WatchEventKind.PUT:
                result = self._on_put(key, value)
            else:
                result = self._on_delete(key)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("%s failed to apply %s %s", self._name, kind, key)

"""Router replica sync: routers of one model share active-load changes on the event plane.

Each router publishes its own ``add`` / ``prefill`` / ``free`` decisions (topic
``active_sequences_events``) and applies the other routers' to its ``ActiveSequences``; its own
echoes are ignored. Sending is fire-and-forget through a bounded queue: when it is full the new
event is dropped and counted, so routing never waits on the event plane. Only active load is
synced, never prefix-cache state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from enum import IntEnum

import msgspec

from dynamo.router.sequences import ActiveSequences, DuplicateRequest, UnknownWorkerRank
from dynamo.runtime.event_plane.base import EventPlane, Subscription
from dynamo.runtime.naming import new_instance_id

log = logging.getLogger(__name__)

SYNC_TOPIC = "active_sequences_events"


class SyncOp(IntEnum):
    ADD = 0
    PREFILL_COMPLETED = 1
    FREE = 2


class SyncEvent(msgspec.Struct, array_like=True, gc=False):
    router_id: int
    model: str
    block_size: int
    op: SyncOp
    request_id: str
    worker_id: int = 0
    dp_rank: int = 0
    sequence_hashes: list[int] = []
    isl_tokens: int = 0
    overlap_blocks: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SyncEvent)


class RouterReplicaSync:
    """One per KV router with ``--router-replica-sync``. ``apply`` is called for peers' events."""

    def __init__(
        self,
        events: EventPlane,
        model: str,
        block_size: int,
        apply: Callable[[SyncEvent], None],
        *,
        queue_size: int = 4096,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.router_id = new_instance_id()
        self._events = events
        self._model = model
        self._block_size = block_size
        self._apply = apply
        self._queue: asyncio.Queue[SyncEvent] = asyncio.Queue(queue_size)
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._on_drop = on_drop
        self.dropped = 0
        self.applied = 0

    async def start(self) -> None:
        self._sub = await self._events.subscribe(SYNC_TOPIC)
        self._tasks = [
            asyncio.create_task(self._send_loop(), name=f"replica-sync-send:{self._model}"),
            asyncio.create_task(self._receive_loop(), name=f"replica-sync-recv:{self._model}"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._sub is not None:
            await self._sub.close()
            self._sub = None

    def publish(
        self,
        op: SyncOp,
        request_id: str,
        worker_id: int = 0,
        dp_rank: int = 0,
        sequence_hashes: list[int] | None = None,
        isl_tokens: int = 0,
        overlap_blocks: int = 0,
    ) -> None:
        """Queue one of our decisions for the peers; never blocks (drops when full)."""
        event = SyncEvent(
            self.router_id,
            self._model,
            self._block_size,
            op,
            request_id,
            worker_id,
            dp_rank,
            sequence_hashes or [],
            isl_tokens,
            overlap_blocks,
        )
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop()

    async def _send_loop(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await self._events.publish(SYNC_TOPIC, _encoder.encode(event))
            except Exception:
                log.warning("replica sync publish failed", exc_info=True)

    async def _receive_loop(self) -> None:
        assert self._sub is not None
        async for message in self._sub:
            try:
                event = _decoder.decode(message.payload)
            except msgspec.DecodeError:
                continue
            if (
                event.router_id == self.router_id
                or event.model != self._model
                or event.block_size != self._block_size
            ):
                continue
            try:
                self._apply(event)
                self.applied += 1
            except Exception:
                log.warning("could not apply a replica-sync event", exc_info=True)


def apply_sync_event(sequences: ActiveSequences, event: SyncEvent) -> None:
    """Apply another router's change to our view of the workers' load (an add of a request we
    have, or on a rank we do not know, is ignored)."""
    if event.op is SyncOp.ADD:
        try:
            sequences.add_request(
                event.request_id,
                event.worker_id,
                event.dp_rank,
                event.sequence_hashes,
                new_isl_tokens=event.isl_tokens,
                overlap_blocks=event.overlap_blocks,
            )
        except (DuplicateRequest, UnknownWorkerRank):
            pass
    elif event.op is SyncOp.PREFILL_COMPLETED:
        sequences.mark_prefill_completed(event.request_id)
    else:
        sequences.free(event.request_id)

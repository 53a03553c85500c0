"""The worker-side KV index (FACTS §2.4): the worker's own block set per dp_rank plus a bounded
buffer of its recent events, answering routers' recovery requests with a tail or a full dump.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from dynamo.protocol.kv_events import (
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    KVCacheEventData,
    KVRecoveryRequest,
    KVRecoveryResponse,
)
from dynamo.router.radix_tree import RadixTree


class LocalKVIndex:
    """What one worker's engine holds, and what it said recently.

    The worker's event publisher passes every engine event through :meth:`record` (which numbers
    it: per rank, consecutive from ``first_event_id``) or :meth:`apply` (already numbered), then
    publishes it. :meth:`answer` serves recovery: the buffered tail from ``start_event_id`` when
    the buffer still covers it, otherwise a dump of the whole state as stored events (event_id 0,
    parents first) with ``last_event_id`` telling the router where live events resume.

    Single owner (the publisher task); nothing here awaits. Dp ranks are small ints >= 0.
    """

    def __init__(self, worker_id: int, *, buffer_size: int = 1024, first_event_id: int = 0) -> None:
        if buffer_size < 0:
            raise ValueError("buffer_size must be >= 0")
        if first_event_id not in (0, 1):
            raise ValueError("first_event_id must be 0 or 1")
        self.worker_id = worker_id
        self._tree = RadixTree()
        self._buffer_size = buffer_size
        self._first_id = first_event_id
        self._buffers: dict[int, deque[KVCacheEvent]] = {}
        self._last: dict[int, int] = {}
        self.skipped = 0
        """Engine events that did not apply cleanly (unknown parent or unknown removed block)."""

    def record(self, data: KVCacheEventData, dp_rank: int = 0) -> KVCacheEvent:
        """Number the next event of ``dp_rank``, apply and buffer it; returns it for publishing."""
        last = self._last.get(dp_rank)
        eid = self._first_id if last is None else last + 1
        event = KVCacheEvent(event_id=eid, data=data, dp_rank=dp_rank)
        self.apply(event)
        return event

    def apply(self, event: KVCacheEvent) -> None:
        """Apply and buffer an already numbered event. Ids must increase; a jump (events the
        engine lost) empties the buffer, so older tails are answered with a dump."""
        rank = event.dp_rank
        if rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {rank}")
        last = self._last.get(rank)
        if last is not None and event.event_id <= last:
            raise ValueError(f"event id {event.event_id} does not follow {last} (rank {rank})")
        buf = self._buffers.get(rank)
        if buf is None:
            buf = self._buffers[rank] = deque(maxlen=self._buffer_size)
        elif last is not None and event.event_id != last + 1:
            buf.clear()
        self._last[rank] = event.event_id
        buf.append(event)
        data = event.data
        if type(data) is BlocksStored:
            ok = self._tree.store(rank, data.parent_hash, data.blocks)
        elif type(data) is BlocksRemoved:
            ok = self._tree.remove(rank, data.block_hashes) == 0
        else:
            self._tree.clear(rank)
            ok = True
        if not ok:
            self.skipped += 1

    def answer(self, request: KVRecoveryRequest) -> KVRecoveryResponse:
        """The tail from ``request.start_event_id`` if buffered, else a full dump of the rank."""
        rank = request.dp_rank
        last = self._last.get(rank)
        if request.digest_only:
            count, digest = self._tree.digest(rank)
            return KVRecoveryResponse(
                worker_id=self.worker_id,
                dp_rank=rank,
                events=[],
                is_dump=False,
                last_event_id=last,
                num_blocks=count,
                digest=digest,
            )
        buf = self._buffers.get(rank)
        start = request.start_event_id
        if start is not None and last is not None and buf and buf[0].event_id <= start <= last + 1:
            tail = list(islice(buf, start - buf[0].event_id, None))
            return KVRecoveryResponse(
                worker_id=self.worker_id,
                dp_rank=rank,
                events=tail,
                is_dump=False,
                last_event_id=last,
            )
        return KVRecoveryResponse(
            worker_id=self.worker_id,
            dp_rank=rank,
            events=self.dump_events(rank),
            is_dump=True,
            last_event_id=last,
        )

    def dump_events(self, dp_rank: int = 0) -> list[KVCacheEvent]:
        return [KVCacheEvent(event_id=0, data=d, dp_rank=dp_rank) for d in self._tree.dump(dp_rank)]

    def last_event_id(self, dp_rank: int = 0) -> int | None:
        return self._last.get(dp_rank)

    def dp_ranks(self) -> list[int]:
        return sorted(self._last)

    def num_blocks(self, dp_rank: int = 0) -> int:
        return self._tree.num_blocks(dp_rank)

    def check_invariants(self) -> None:
        self._tree.check_invariants()
        for rank, buf in self._buffers.items():
            ids = [ev.event_id for ev in buf]
            if ids and (ids[-1] != self._last[rank] or ids != list(range(ids[0], ids[-1] + 1))):
                raise AssertionError(f"rank {rank} buffer ids not consecutive up to the last id")

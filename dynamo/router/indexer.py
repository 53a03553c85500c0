"""The router's prefix index fed by KV events (FACTS §2.4, §3.1): applies stored/removed/cleared
events per (worker, dp_rank), tracks event ids, detects gaps and ingests recovery responses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from dynamo import native
from dynamo.protocol.kv_events import (
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    KVCacheEventData,
    KVEventBatch,
    KVRecoveryRequest,
    KVRecoveryResponse,
)
from dynamo.protocol.kv_raw import decode
from dynamo.router.radix_tree import RadixTree
from dynamo.router.slots import SlotMap, WorkerKey

_applier = native.load("dynamo.router._apply_raw", "dynamo.router._apply_raw_fallback")
APPLY_RAW_IMPLEMENTATION: str = _applier.__name__
"""The in-order raw apply in use (``dynamo.router._apply_raw`` or its ``_fallback``)."""


class EventStatus(StrEnum):
    """What happened to one event; the values are the ``status`` label of events-applied metrics."""

    OK = "ok"
    PARENT_BLOCK_NOT_FOUND = "parent_block_not_found"  # stored under an unknown parent: skipped
    BLOCK_NOT_FOUND = "block_not_found"  # a removal named an unknown block (the rest applied)
    GAP = "gap"  # ids skipped: recovery started, the event is held for after it
    STALE = "stale"  # id already applied (a duplicate, or covered by a dump): ignored
    BUFFERED = "buffered"  # held while this worker rank awaits its recovery response
    DROPPED = "dropped"  # recovery buffer full: discarded (a later gap recovers it)


@dataclass(slots=True)
class _Rank:
    slot: int
    last_id: int | None = None
    recovering: bool = False
    want_dump: bool = False
    buffer: list[KVCacheEvent] = field(default_factory=list)


class KVIndexer:
    """Prefix index of every (worker_id, dp_rank)'s device blocks, fed by their KV events.

    Event ids: per worker rank the next event must carry ``last + 1``; the first may be 0 or 1.
    A larger id is a **gap**: :meth:`apply` returns :attr:`EventStatus.GAP` and the rank enters
    recovery. The owner then sends :meth:`recovery_request` to that worker's local index and hands
    the answer to :meth:`apply_recovery`. Until then the rank keeps its (possibly stale) blocks
    and live events are buffered (bounded), then replayed after the response. A router that meets
    a worker late starts the same way (``recovery_request`` with no id known asks for a dump).

    Single owner, no awaits: call every method from one task (the router's event loop task).
    """

    def __init__(self, *, recovery_buffer_limit: int = 10_000) -> None:
        if recovery_buffer_limit < 0:
            raise ValueError("recovery_buffer_limit must be >= 0")
        self._tree = RadixTree()
        self._slots = SlotMap()
        self._key_of = self._slots.key_list()  # slot -> key, live (the map's own list)
        self._ranks: dict[WorkerKey, _Rank] = {}
        self._buffer_limit = recovery_buffer_limit
        self.counters: dict[EventStatus, int] = dict.fromkeys(EventStatus, 0)
        """Events seen by status (metrics: kv_cache_events_applied{status})."""
        # apply_raw's common buffer in one native call (it holds the ranks, tree and counters)
        self.apply_in_order: Callable[[int, bytes], bool] = _applier.InOrderApplier(
            self._ranks,
            self._tree,
            self.counters,
            EventStatus.OK,
            EventStatus.PARENT_BLOCK_NOT_FOUND,
            EventStatus.BLOCK_NOT_FOUND,
        ).apply
        """``apply_in_order(worker_id, raw)``: :meth:`apply_raw` of a buffer that is its rank's
        next one (True), or nothing changed (False: :meth:`apply_raw` decodes it)."""

    # --- events ----------------------------------------------------------------------------------

    def apply(self, worker_id: int, event: KVCacheEvent) -> EventStatus:
        """Apply one live event of ``worker_id`` (rank ``event.dp_rank``); see the class doc."""
        st = self._ranks.get((worker_id, event.dp_rank))
        if st is None:
            st = self._rank((worker_id, event.dp_rank))
        status = self._apply_tracked(st, event)
        self.counters[status] += 1
        return status

    def apply_batch(self, batch: KVEventBatch) -> list[WorkerKey]:
        """Apply a worker's batch in order; returns the ranks that entered recovery (gaps)."""
        return self.apply_events(batch.worker_id, batch.events)

    def apply_events(self, worker_id: int, events: Sequence[KVCacheEvent]) -> list[WorkerKey]:
        """:meth:`apply` each of ``worker_id``'s live ``events`` in order (the same statuses
        and counters); returns the ranks that entered recovery (gaps), one entry per gap.

        One call per batch: the offline replay applies every pass's events here. The common
        case (the rank is not recovering and the id is the next one) goes straight to
        :meth:`_apply_data`; anything else takes :meth:`_apply_tracked`."""
        gaps: list[WorkerKey] = []
        ranks, counters = self._ranks, self.counters
        for event in events:
            key = (worker_id, event.dp_rank)
            st = ranks.get(key)
            if st is None:
                st = self._rank(key)
            last, eid = st.last_id, event.event_id
            if st.recovering or last is None or eid != last + 1:
                status = self._apply_tracked(st, event)
                if status is EventStatus.GAP:
                    gaps.append(key)
            else:
                st.last_id = eid
                status = self._apply_data(st, event.data)
            counters[status] += 1
        return gaps

    def apply_raw(self, worker_id: int, raw: bytes) -> list[WorkerKey]:
        """:meth:`apply_events` of a raw buffer (``dynamo.protocol.kv_raw``: one rank's
        consecutive events, the offline replay's pass), with the same statuses, counters and
        result. When its first id is the rank's next one and the rank is not recovering, the
        tree applies it in one call, decided and counted by ``_apply_raw.InOrderApplier``;
        otherwise it is decoded."""
        if self.apply_in_order(worker_id, raw):
            return []
        return self.apply_events(worker_id, decode(raw))

    def apply_data(self, worker_id: int, dp_rank: int, data: KVCacheEventData) -> EventStatus:
        """Apply event data without event-id tracking (tests, approximate feeds)."""
        status = self._apply_data(self._rank((worker_id, dp_rank)), data)
        self.counters[status] += 1
        return status

    # --- recovery --------------------------------------------------------------------------------

    def recovery_request(
        self, worker_id: int, dp_rank: int = 0, *, full: bool = False
    ) -> KVRecoveryRequest:
        """Start (or repeat) recovery of a worker rank and return the request for its local index:
        the tail after the last applied id, or a full dump (``full``, no id known yet, or a tail
        that did not connect). Live events are buffered until :meth:`apply_recovery`."""
        st = self._rank((worker_id, dp_rank))
        st.recovering = True
        start = None if full or st.want_dump or st.last_id is None else st.last_id + 1
        return KVRecoveryRequest(dp_rank=dp_rank, start_event_id=start)

    def apply_recovery(self, response: KVRecoveryResponse) -> EventStatus:
        """Ingest a local index's answer, then replay the buffered live events.

        A dump replaces the rank's blocks and sets its last id to ``response.last_event_id``; a tail
        is applied like live events. Returns GAP if the rank still needs recovery (ask again with
        :meth:`recovery_request`), else OK.
        """
        st = self._rank((response.worker_id, response.dp_rank))
        buffered, st.buffer = st.buffer, []
        st.recovering = False
        if response.is_dump:
            self._tree.clear(st.slot)
            for ev in response.events:
                self.counters[self._apply_data(st, ev.data)] += 1
            st.last_id = response.last_event_id
            st.want_dump = False
        else:
            for ev in response.events:
                self.counters[self._apply_tracked(st, ev)] += 1
            st.want_dump = st.recovering  # a tail that did not connect: ask for a dump next
        for ev in buffered:
            self.counters[self._apply_tracked(st, ev)] += 1
        return EventStatus.GAP if st.recovering else EventStatus.OK

    def cancel_recovery(self, worker_id: int, dp_rank: int = 0) -> None:
        """Give up a recovery (the request failed): drop the buffer; the next event gaps again."""
        st = self._ranks.get((worker_id, dp_rank))
        if st is not None:
            st.recovering = False
            st.buffer = []

    def is_recovering(self, worker_id: int, dp_rank: int = 0) -> bool:
        st = self._ranks.get((worker_id, dp_rank))
        return st is not None and st.recovering

    def last_event_id(self, worker_id: int, dp_rank: int = 0) -> int | None:
        st = self._ranks.get((worker_id, dp_rank))
        return None if st is None else st.last_id

    # --- queries and membership ------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """(worker_id, dp_rank) -> leading blocks of ``local_hashes`` it holds; zeros omitted."""
        return self._slots.to_keys(self._tree.find_matches(local_hashes))

    def slot_matches(self, local_hashes: Sequence[int]) -> tuple[dict[int, int], list[WorkerKey]]:
        """:meth:`find_matches` before re-keying: slot -> leading blocks, and the live slot ->
        (worker_id, dp_rank) list to read the slots with (valid until the membership changes)."""
        return self._tree.find_matches(local_hashes), self._key_of

    def slot_finder(self) -> tuple[Callable[[Sequence[int]], dict[int, int]], list[WorkerKey]]:
        """:meth:`slot_matches`' two parts, to hold: the tree's ``find_matches`` and the live
        slot -> key list."""
        return self._tree.find_matches, self._key_of

    def remove_worker(self, worker_id: int) -> None:
        """Forget every rank of a worker (it left discovery): blocks, ids, recovery state."""
        for key in [k for k in self._ranks if k[0] == worker_id]:
            st = self._ranks.pop(key)
            self._tree.clear(st.slot)
            self._slots.release(key)

    def clear(self, worker_id: int, dp_rank: int = 0) -> None:
        """Drop the blocks of one worker rank (event-id tracking is kept)."""
        st = self._ranks.get((worker_id, dp_rank))
        if st is not None:
            self._tree.clear(st.slot)

    def dump_events(self, worker_id: int, dp_rank: int = 0) -> list[KVCacheEvent]:
        """The rank's blocks as stored events (event_id 0, parents first)."""
        st = self._ranks.get((worker_id, dp_rank))
        if st is None:
            return []
        return [KVCacheEvent(event_id=0, data=d, dp_rank=dp_rank) for d in self._tree.dump(st.slot)]

    def workers(self) -> list[WorkerKey]:
        """Worker ranks currently known (with or without blocks)."""
        return list(self._ranks)

    def digest(self, worker_id: int, dp_rank: int = 0) -> tuple[int, int]:
        """(blocks, digest) of the rank's block set, comparable with its local index's."""
        st = self._ranks.get((worker_id, dp_rank))
        return (0, 0) if st is None else self._tree.digest(st.slot)

    def num_blocks(self, worker_id: int, dp_rank: int = 0) -> int:
        st = self._ranks.get((worker_id, dp_rank))
        return 0 if st is None else self._tree.num_blocks(st.slot)

    @property
    def tree_blocks(self) -> int:
        """Distinct blocks indexed (prefix paths, whoever holds them): the index's memory."""
        return self._tree.num_blocks_total

    @property
    def num_nodes(self) -> int:
        """Runs in the path-compressed tree (walks it; tests and occasional metrics)."""
        return self._tree.num_nodes

    def check_invariants(self) -> None:
        self._tree.check_invariants()
        for key, st in self._ranks.items():
            if self._slots.get(key) != st.slot:
                raise AssertionError(f"{key} slot mapping corrupt")
            if st.buffer and not st.recovering:
                raise AssertionError(f"{key} buffers events outside recovery")
        if set(self._tree.slots()) - {st.slot for st in self._ranks.values()}:
            raise AssertionError("tree holds blocks of an unknown slot")

    # --- internals -------------------------------------------------------------------------------

    def _rank(self, key: WorkerKey) -> _Rank:
        st = self._ranks.get(key)
        if st is None:
            st = self._ranks[key] = _Rank(self._slots.slot(key))
        return st

    def _apply_tracked(self, st: _Rank, event: KVCacheEvent) -> EventStatus:
        if st.recovering:
            if len(st.buffer) >= self._buffer_limit:
                return EventStatus.DROPPED
            st.buffer.append(event)
            return EventStatus.BUFFERED
        eid = event.event_id
        last = st.last_id
        if last is None:
            in_order = eid <= 1  # numbering starts at 0 or 1
        else:
            if eid <= last:
                return EventStatus.STALE
            in_order = eid == last + 1
        if not in_order:
            st.recovering = True
            st.buffer.append(event)
            return EventStatus.GAP
        st.last_id = eid
        return self._apply_data(st, event.data)

    def _apply_data(self, st: _Rank, data: KVCacheEventData) -> EventStatus:
        if type(data) is BlocksStored:
            if self._tree.store(st.slot, data.parent_hash, data.blocks):
                return EventStatus.OK
            return EventStatus.PARENT_BLOCK_NOT_FOUND
        if type(data) is BlocksRemoved:
            if self._tree.remove(st.slot, data.block_hashes):
                return EventStatus.BLOCK_NOT_FOUND
            return EventStatus.OK
        self._tree.clear(st.slot)
        return EventStatus.OK

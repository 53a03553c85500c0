"""The KV router's synchronous core: index + active load + selection (FACTS §3-§5).

``RoutingCore`` is everything the KV router decides with, and nothing it waits for: no asyncio,
no sockets, no wall clock unless one is handed in. The live router (``router/kv_router.py``) is a
thin async shell around it (event subscription, recovery, replica sync); the offline replay
(``dynamo.replay``) drives the very same object on a virtual clock. One owner calls every method.

Per request: local block hashes -> prefix overlap per (worker, dp_rank) from the index (KV
events, or the approximate TTL index of our own decisions) -> load per rank from
``ActiveSequences`` -> cost and choice (``selector.select_worker``) -> the request's load is
recorded until its first token (prefill) and its end (decode blocks).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo import native
from dynamo.protocol.kv_events import KVCacheEvent
from dynamo.router.approx import ApproxIndex
from dynamo.router.block_counts import new_blocks_of_keys, prefix_key_bytes
from dynamo.router.config import KVRouterSettings
from dynamo.router.hashing import sequence_hashes
from dynamo.router.indexer import EventStatus, KVIndexer
from dynamo.router.selector import Candidate, Selection, choose, column_costs, select_worker
from dynamo.router.sequences import (
    ActiveSequences,
    DuplicateRequest,
    UnknownWorkerRank,
    add_routed,
    free,
    mark_prefill_completed,
)
from dynamo.runtime.errors import NoInstances

_kernel = native.load("dynamo.router._route", "dynamo.router._route_fallback")
ROUTE_IMPLEMENTATION: str = _kernel.__name__
"""The route kernel in use (``dynamo.router._route`` or ``dynamo.router._route_fallback``)."""
_recorder = native.load("dynamo.router._route_record", "dynamo.router._route_record_fallback")
if TYPE_CHECKING:
    from dynamo.router._route import choose as _choose
    from dynamo.router._route_record import RouteRecorder
else:
    _choose = _kernel.choose
    RouteRecorder = _recorder.RouteRecorder


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What the core needs to know about one worker (from its model card)."""

    worker_id: int
    dp_start: int = 0
    dp_size: int = 1
    total_kv_blocks: int | None = None  # the decode-blocks busy threshold needs it
    max_num_batched_tokens: int | None = None  # the fractional prefill threshold needs it

    @property
    def ranks(self) -> range:
        return range(self.dp_start, self.dp_start + self.dp_size)


class RoutingCore:
    """Synchronous KV routing for one model.

    Workers are added and removed explicitly (from discovery live, from the deployment in a
    replay), never on first route. ``route`` records the chosen rank's new load; the owner then
    reports ``prefill_completed`` (first token) and ``free`` (end, error, cancel). KV events go
    through ``apply_event``; with ``use_kv_events`` off the core indexes its own decisions for
    ``ttl_secs`` instead (approximate mode).

    ``clock`` times stale-request expiry and the approximate index's TTL: the replay passes its
    virtual clock.
    """

    def __init__(
        self,
        block_size: int,
        settings: KVRouterSettings,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.settings = settings
        self.rng = rng or random.Random()
        self.selector = settings.selector_config()
        # the route kernel's call (_choose) serves every request: temperature 0, none busy
        self._one_call = self.selector.temperature == 0 and not self.selector.has_busy_thresholds
        self._cost_params = self.selector.cost_params
        self._kv_reuse = settings.assume_kv_reuse  # the load accounting keeps prefix keys
        self.indexer: KVIndexer | None = KVIndexer() if settings.use_kv_events else None
        self.approx: ApproxIndex | None = (
            None if settings.use_kv_events else ApproxIndex(settings.ttl_secs, clock=clock)
        )
        self.sequences = ActiveSequences(
            block_size, assume_kv_reuse=settings.assume_kv_reuse, clock=clock
        )
        self.workers: dict[int, WorkerSpec] = {}
        self._targets: list[tuple[WorkerSpec, int]] = []  # every (worker, rank), in join order
        self._target_keys: list[tuple[int, int]] = []  # their (worker_id, rank), same order
        self._target_index: dict[tuple[int, int], int] = {}  # a key's place in _target_keys
        self._recorder: RouteRecorder | None = None  # the common request in one call (_choose)

    # -- membership ------------------------------------------------------------------------
    def add_worker(self, worker: WorkerSpec) -> bool:
        """Track a worker's ranks; False (nothing changes) if it is already tracked."""
        if worker.worker_id in self.workers:
            return False
        self.workers[worker.worker_id] = worker
        self.sequences.add_worker(worker.worker_id, worker.ranks)
        self._targets.extend((worker, rank) for rank in worker.ranks)
        self._keys_changed()
        return True

    def remove_worker(self, worker_id: int) -> bool:
        """Forget a worker: its index and its load. False if it was not tracked."""
        if self.workers.pop(worker_id, None) is None:
            return False
        self._targets = [t for t in self._targets if t[0].worker_id != worker_id]
        self._keys_changed()
        self.sequences.remove_worker(worker_id)
        if self.indexer is not None:
            self.indexer.remove_worker(worker_id)
        if self.approx is not None:
            self.approx.remove_worker(worker_id)
        return True

    # -- KV events -------------------------------------------------------------------------
    def apply_event(self, worker_id: int, event: KVCacheEvent) -> EventStatus:
        """Apply one KV event of a tracked worker (approximate mode: ignored, OK)."""
        if self.indexer is None:
            return EventStatus.OK
        return self.indexer.apply(worker_id, event)

    def apply_events(self, worker_id: int, events: Sequence[KVCacheEvent] | bytes) -> None:
        """:meth:`apply_event` each of ``events`` in order, in one call (the offline replay's
        pass end). Gaps start recovery in the indexer as with one event at a time. ``bytes``:
        the events in their raw form (``dynamo.protocol.kv_raw``, ``KVIndexer.apply_raw``)."""
        indexer = self.indexer
        if indexer is not None:
            if isinstance(events, bytes):  # the common buffer in one native call, else decoded
                if not indexer.apply_in_order(worker_id, events):
                    indexer.apply_raw(worker_id, events)
            else:
                indexer.apply_events(worker_id, events)

    # -- routing ---------------------------------------------------------------------------
    def route(
        self,
        request_id: str,
        local_hashes: Sequence[int],
        isl_tokens: int,
        *,
        seq_hashes: Sequence[int] | None = None,
        allowed: Collection[int] | None = None,
        pinned_worker: int | None = None,
        dp_rank: int | None = None,
        record: bool = True,
        overlaps: dict[tuple[int, int], int] | None = None,
        prefix_keys: bytes | None = None,
    ) -> Selection:
        """Choose a (worker, rank) for a request and (``record``) count its load there.

        ``local_hashes``: the prompt's complete blocks (``router.hashing``); ``seq_hashes``
        their chained form (computed if omitted). ``allowed``: the live worker ids to choose
        among (None: every tracked worker); ``pinned_worker``/``dp_rank`` narrow it further
        (routing hints); ``overlaps``: :meth:`find_matches` of ``local_hashes`` when the caller
        computed it already (it times the phases); ``prefix_keys``: :meth:`prefix_keys` of
        ``seq_hashes`` when the caller computed it (it records separately; computed here if
        omitted, once for the load projection and the record). Raises ``NoInstances`` when nothing
        matches and ``Overloaded`` when every match is busy. A duplicate ``request_id``
        routes but counts its load once.
        """
        if allowed is None and pinned_worker is None and dp_rank is None and self._targets:
            targets = self._targets
        else:
            targets = self._eligible(allowed, pinned_worker, dp_rank)
        if seq_hashes is None:
            seqs = sequence_hashes(local_hashes)
        else:  # read only here (what is kept is copied): a list is used as it is
            seqs = seq_hashes if isinstance(seq_hashes, list) else list(seq_hashes)
        if prefix_keys is None and self._kv_reuse:
            prefix_keys = prefix_key_bytes(seqs)
        if self._one_call and targets is self._targets:  # the common request: one kernel call
            recorder = self._recorder
            if recorder is not None and overlaps is None and prefix_keys is not None:
                chosen = recorder.route(
                    request_id, local_hashes, seqs, isl_tokens, prefix_keys, record
                )
                if chosen is not None:
                    return chosen  # type: ignore[no-any-return]
                self._recorder = None  # the ranks changed: _choose routes and builds anew
            return self._choose(
                request_id, local_hashes, seqs, isl_tokens, overlaps, prefix_keys, record
            )
        selector = self.selector
        if overlaps is None:
            overlaps = self.find_matches(local_hashes)
        if selector.has_busy_thresholds:  # filtering needs each candidate's whole load
            options = self._candidates(targets, seqs, overlaps)
            chosen = select_worker(options, isl_tokens, self.block_size, selector, self.rng)
        else:
            chosen = self._select(targets, seqs, overlaps, isl_tokens, prefix_keys)
        if record:
            self.record(request_id, chosen, seqs, isl_tokens, local_hashes, prefix_keys)
        return chosen

    def prefix_keys(self, seq_hashes: Sequence[int]) -> bytes | None:
        """What the load accounting keeps of a request's blocks (``prefix_key_bytes``; None
        when it keeps none: ``assume_kv_reuse`` off), for :meth:`route` and :meth:`record`."""
        return prefix_key_bytes(seq_hashes) if self._kv_reuse else None

    def find_matches(self, local_hashes: Sequence[int]) -> dict[tuple[int, int], int]:
        """Matched prefix blocks per (worker, rank) in the index (exact or approximate)."""
        index = self.indexer if self.indexer is not None else self.approx
        assert index is not None
        return index.find_matches(local_hashes) if local_hashes else {}

    def record(
        self,
        request_id: str,
        chosen: Selection,
        seq_hashes: Sequence[int],
        isl_tokens: int,
        local_hashes: Sequence[int] = (),
        prefix_keys: bytes | None = None,
    ) -> bool:
        """Count a routed request's load on its rank (and, approximate mode, its prefix).
        False if the id is already active (its load stays counted once) or the rank left.
        ``prefix_keys``: :meth:`prefix_keys` of ``seq_hashes`` if the caller has it."""
        try:  # add_request checks both before it changes anything (one lookup each)
            self.sequences.add_request(
                request_id,
                chosen.worker_id,
                chosen.dp_rank,
                seq_hashes,
                new_isl_tokens=isl_tokens,
                overlap_blocks=chosen.overlap_blocks,
                prefix_keys=prefix_keys,
            )
        except (DuplicateRequest, UnknownWorkerRank):
            return False
        if self.approx is not None and local_hashes:
            self.approx.record(chosen.worker_id, chosen.dp_rank, local_hashes, seq_hashes)
        return True

    def prefill_completed(self, request_id: str) -> bool:
        """First token seen: the request's prefill tokens leave its rank's load."""
        return mark_prefill_completed(self.sequences, request_id)  # its method, no frame

    def free(self, request_id: str) -> bool:
        """The request ended: everything it held leaves its rank's load. Idempotent."""
        return free(self.sequences, request_id)  # ActiveSequences.free, without its frame

    def saturated(
        self,
        allowed: Collection[int] | None = None,
        pinned_worker: int | None = None,
        dp_rank: int | None = None,
    ) -> bool:
        """Whether a request with these eligibility hints must wait in the router queue (FACTS
        §4.5): a queue threshold is set and every eligible rank has ``active_prefill_tokens >
        threshold * max_num_batched_tokens``. A worker whose ``max_num_batched_tokens`` is
        unknown is never saturated; no eligible rank at all is not saturation (routing then
        raises ``NoInstances``)."""
        threshold = self.settings.queue_threshold
        if threshold is None:
            return False
        try:
            targets = self._eligible(allowed, pinned_worker, dp_rank)
        except NoInstances:
            return False
        prefill_tokens = self.sequences.active_prefill_tokens
        for worker, rank in targets:
            capacity = worker.max_num_batched_tokens
            if capacity is None or prefill_tokens(worker.worker_id, rank) <= threshold * capacity:
                return False
        return True

    # -- internals -------------------------------------------------------------------------
    def _keys_changed(self) -> None:
        self._recorder = None
        self._target_keys = [(w.worker_id, r) for w, r in self._targets]
        self._target_index = {key: i for i, key in enumerate(self._target_keys)}

    def _covers(self, allowed: Collection[int]) -> bool:
        """Whether ``allowed`` holds every tracked worker (the live router passes the live
        ones: normally all of them)."""
        if isinstance(allowed, AbstractSet):
            return allowed >= self.workers.keys()
        return all(worker_id in allowed for worker_id in self.workers)

    def _eligible(
        self, allowed: Collection[int] | None, pinned: int | None, rank: int | None
    ) -> list[tuple[WorkerSpec, int]]:
        if pinned is None and rank is None and (allowed is None or self._covers(allowed)):
            targets = self._targets  # every target: the route kernel's whole-target call
        else:
            targets = [
                (w, r)
                for w, r in self._targets
                if (allowed is None or w.worker_id in allowed)
                and (pinned is None or w.worker_id == pinned)
                and (rank is None or r == rank)
            ]
        if not targets:
            if pinned is not None or rank is not None:
                raise NoInstances("no live worker matches the request's instance / DP-rank hints")
            raise NoInstances("no live instance")
        return targets

    def _choose(
        self,
        request_id: str,
        local_hashes: Sequence[int],
        seqs: list[int],
        isl_tokens: int,
        overlaps: dict[tuple[int, int], int] | None,
        prefix_keys: bytes | None,
        record: bool,
    ) -> Selection:
        """:meth:`_select` over every target at temperature 0, in one call of the route kernel
        (``_route.pyi``: the index's matches, the ranks' loads, the costs and the choice), and
        (``record``) :meth:`record` on the chosen rank as the kernel read it (no lookup)."""
        key_of: list[tuple[int, int]] | None = None
        matches: dict[Any, int]
        if overlaps is not None:  # the caller's find_matches (keyed by worker)
            matches = overlaps
        elif not local_hashes:
            matches = {}
        elif self.indexer is not None:  # slots of the index, read through key_of
            matches, key_of = self.indexer.slot_matches(local_hashes)
        else:
            assert self.approx is not None
            matches = self.approx.find_matches(local_hashes)
        keys = self._target_keys
        sequences = self.sequences
        ranks, new, _ = sequences.rank_loads(seqs, keys, prefix_keys)
        bs = self.block_size
        if key_of is not None and prefix_keys is not None and self._recorder is None:
            self._recorder = self._new_recorder(ranks)
        i, overlap, costs = _choose(
            matches,
            key_of,
            self._target_index,
            ranks,
            new,
            isl_tokens,
            bs,
            self._cost_params,
            self.rng,
            self.settings.track_active_blocks,
        )
        worker_id, dp_rank = keys[i]
        chosen = Selection(
            worker_id,
            dp_rank,
            costs[i],
            overlap,
            min(overlap * bs, max(isl_tokens, 0)),
            keys,
            costs,
        )
        if (
            record
            and sequences.add_routed(request_id, ranks[i], seqs, isl_tokens, overlap, prefix_keys)
            and self.approx is not None
            and local_hashes
        ):
            self.approx.record(worker_id, dp_rank, local_hashes, seqs)
        return chosen

    def _new_recorder(self, ranks: list[Any]) -> RouteRecorder:
        """The common request's one call for the current targets (``_route_record.pyi``),
        valid while ``sequences.resolved`` stays the one ``ranks`` came with."""
        assert self.indexer is not None
        find, key_of = self.indexer.slot_finder()
        return RouteRecorder(
            find,
            key_of,
            self._target_index,
            self._target_keys,
            ranks,
            [rank.blocks for rank in ranks],
            self.sequences.resolved,
            self.sequences,
            add_routed,
            new_blocks_of_keys,
            _choose,
            Selection,
            self._cost_params,
            self.rng,
            self.settings.track_active_blocks,
            self.block_size,
        )

    def _select(
        self,
        targets: list[tuple[WorkerSpec, int]],
        seqs: list[int],
        overlaps: dict[tuple[int, int], int],
        isl_tokens: int,
        prefix_keys: bytes | None,
    ) -> Selection:
        """``select_worker`` without busy thresholds, over columns: the per-target work is list
        building and the cost kernel (``selector.column_costs``), no ``Candidate`` objects."""
        index: dict[tuple[int, int], int] | None = None
        if targets is self._targets:
            keys, index = self._target_keys, self._target_index
        else:
            keys = [(w.worker_id, r) for w, r in targets]
        prefill, decode, new, requests = self.sequences.load_columns(seqs, keys, prefix_keys)
        if not self.settings.track_active_blocks:
            decode = new = [0] * len(keys)
        overlap = [0] * len(keys)
        if index is not None:  # the matched ranks only (few of many): their places by key
            for key, blocks in overlaps.items():
                place = index.get(key)
                if place is not None:
                    overlap[place] = blocks
        elif overlaps:
            get = overlaps.get
            overlap = [get(key, 0) for key in keys]
        bs = self.block_size
        costs = column_costs(overlap, prefill, decode, new, requests, isl_tokens, bs, self.selector)
        i = choose(costs, self.selector, self.rng)
        worker_id, dp_rank = keys[i]
        return Selection(
            worker_id=worker_id,
            dp_rank=dp_rank,
            cost=costs[i],
            overlap_blocks=overlap[i],
            cached_tokens=min(overlap[i] * bs, max(isl_tokens, 0)),
            scored=keys,
            scores=costs,
        )

    def _candidates(
        self,
        targets: list[tuple[WorkerSpec, int]],
        seqs: list[int],
        overlaps: dict[tuple[int, int], int],
    ) -> list[Candidate]:
        loads = {(p.worker_id, p.dp_rank): p for p in self.sequences.project_loads(seqs)}
        track_blocks = self.settings.track_active_blocks
        n_blocks = len(seqs)
        out: list[Candidate] = []
        for worker, rank in targets:
            key = (worker.worker_id, rank)
            load = loads.get(key)
            out.append(
                Candidate(
                    worker_id=worker.worker_id,
                    dp_rank=rank,
                    overlap_blocks=overlaps.get(key, 0),
                    active_prefill_tokens=load.active_prefill_tokens if load else 0,
                    active_decode_blocks=load.active_decode_blocks if load and track_blocks else 0,
                    new_decode_blocks=(load.new_decode_blocks if load else n_blocks)
                    if track_blocks
                    else 0,
                    active_requests=load.active_requests if load else 0,
                    total_kv_blocks=worker.total_kv_blocks,
                    max_num_batched_tokens=worker.max_num_batched_tokens,
                )
            )
        return out

"""The slot tracker's state: one ActiveSequences per (model_name, tenant_id), its workers and ranks.

Every HTTP write lands here; local lifecycle writes are handed to the replica publisher, and
replica events from peers are applied through ``apply_replica`` (never creating workers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from dynamo.router.block_counts import BlockCounts
from dynamo.router.sequences import (
    DEFAULT_EXPIRY_S,
    ActiveSequences,
    DuplicateRequest,
    PotentialLoad,
    UnknownWorkerRank,
)

log = logging.getLogger(__name__)

U32_MAX = (1 << 32) - 1
MAX_DP_SIZE = 65536
"""Ranks one registration may cover: each rank costs memory, so absurd ranges are refused."""

TrackerKey = tuple[str, str]
"""``(model_name, tenant_id)``."""


class TrackerError(Exception):
    """A request the registry refuses; ``status`` is the HTTP status that reports it."""

    status = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class WorkerInfo(msgspec.Struct, gc=False):
    worker_id: int
    model_name: str
    tenant_id: str
    block_size: int
    dp_start: int
    dp_size: int


class LoadInfo(msgspec.Struct, gc=False):
    model_name: str
    tenant_id: str
    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int


class Op:
    """Lifecycle operations carried by replica events."""

    ADD = 0
    PREFILL_COMPLETE = 1
    FREE = 2


# publish(key, block_size, op, request_id, worker_id, dp_rank, sequence_hashes, new_isl_tokens)
Publisher = Callable[[TrackerKey, int, int, str, int, int, Sequence[int], int], None]


@dataclass(slots=True, eq=False)
class _Tracker:
    block_size: int
    sequences: ActiveSequences
    # worker_id -> (dp_start, dp_size)
    workers: dict[int, tuple[int, int]] = field(default_factory=dict)


def _tracker_missing(key: TrackerKey) -> TrackerError:
    return TrackerError(f"no slot tracker for model={key[0]} tenant={key[1]}", 404)


class Registry:
    """Trackers keyed by (model_name, tenant_id); worker ids are scoped by that key.

    A tracker appears with its first registered worker and disappears with its last one (its
    block size is then free to change). ``publish`` is called after each successful local
    lifecycle write (add, prefill_complete, free); replica events are applied without it.
    """

    def __init__(
        self,
        *,
        expiry_s: float = DEFAULT_EXPIRY_S,
        publish: Publisher | None = None,
    ) -> None:
        self._trackers: dict[TrackerKey, _Tracker] = {}
        self._expiry_s = expiry_s
        self._publish = publish
        self.replica_dropped = 0
        self.replica_applied = 0

    @property
    def trackers_by_key(self) -> dict[TrackerKey, _Tracker]:
        """The live table of trackers (read, never written, by ``_loads.c``'s /potential_loads)."""
        return self._trackers

    def set_publisher(self, publish: Publisher | None) -> None:
        self._publish = publish

    # ---------------------------------------------------------------- topology

    def register(
        self,
        key: TrackerKey,
        worker_id: int,
        block_size: int,
        dp_start: int,
        dp_size: int,
    ) -> None:
        if block_size <= 0:
            raise TrackerError("block_size must be greater than 0")
        if dp_size <= 0:
            raise TrackerError("dp_size must be greater than 0")
        if dp_start + dp_size > U32_MAX:
            raise TrackerError(f"dp range overflows u32: start={dp_start} size={dp_size}")
        if dp_size > MAX_DP_SIZE:
            raise TrackerError(f"dp_size must be at most {MAX_DP_SIZE}")
        tracker = self._trackers.get(key)
        if tracker is None:
            tracker = _Tracker(block_size, ActiveSequences(block_size, expiry_s=self._expiry_s))
            self._trackers[key] = tracker
        elif tracker.block_size != block_size:
            raise TrackerError(
                f"block_size mismatch for model={key[0]} tenant={key[1]}: "
                f"existing={tracker.block_size}, requested={block_size}",
                409,
            )
        if worker_id in tracker.workers:
            raise TrackerError(
                f"worker {worker_id} already registered for model={key[0]} tenant={key[1]}", 409
            )
        tracker.workers[worker_id] = (dp_start, dp_size)
        tracker.sequences.add_worker(worker_id, range(dp_start, dp_start + dp_size))

    def unregister(self, key: TrackerKey, worker_id: int) -> None:
        """Remove the worker's whole DP range and its active requests."""
        tracker = self._trackers.get(key)
        if tracker is None or worker_id not in tracker.workers:
            raise TrackerError(
                f"worker {worker_id} not found for model={key[0]} tenant={key[1]}", 404
            )
        del tracker.workers[worker_id]
        tracker.sequences.remove_worker(worker_id)
        if not tracker.workers:
            del self._trackers[key]

    def list_workers(self, model_name: str | None, tenant_id: str | None) -> list[WorkerInfo]:
        out = [
            WorkerInfo(worker_id, key[0], key[1], tracker.block_size, start, size)
            for key, tracker in self._matching(model_name, tenant_id)
            for worker_id, (start, size) in tracker.workers.items()
        ]
        out.sort(key=lambda w: (w.model_name, w.tenant_id, w.worker_id))
        return out

    # --------------------------------------------------------------- lifecycle

    def add(
        self,
        key: TrackerKey,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int,
    ) -> None:
        tracker = self._trackers.get(key)
        if tracker is None:
            raise _tracker_missing(key)
        try:
            tracker.sequences.add_request(
                request_id, worker_id, dp_rank, sequence_hashes, new_isl_tokens=new_isl_tokens
            )
        except DuplicateRequest as exc:
            raise TrackerError(f"request {request_id} already exists", 409) from exc
        except UnknownWorkerRank as exc:
            raise TrackerError(
                f"worker {worker_id} dp_rank {dp_rank} not found "
                f"for model={key[0]} tenant={key[1]}",
                404,
            ) from exc
        if self._publish is not None:
            self._publish(
                key,
                tracker.block_size,
                Op.ADD,
                request_id,
                worker_id,
                dp_rank,
                sequence_hashes,
                new_isl_tokens,
            )

    def prefill_complete(self, key: TrackerKey, request_id: str) -> None:
        tracker = self._trackers.get(key)
        if tracker is None:
            raise _tracker_missing(key)
        sequences = tracker.sequences
        if self._publish is None:
            if not sequences.mark_prefill_completed(request_id):
                raise TrackerError(f"request {request_id} not found", 404)
            return
        where = sequences.worker_of(request_id)
        if where is None:
            raise TrackerError(f"request {request_id} not found", 404)
        sequences.mark_prefill_completed(request_id)
        self._publish(
            key, tracker.block_size, Op.PREFILL_COMPLETE, request_id, where[0], where[1], (), 0
        )

    def free(self, key: TrackerKey, request_id: str) -> None:
        """Idempotent while the tracker exists: an unknown request is a no-op."""
        tracker = self._trackers.get(key)
        if tracker is None:
            raise _tracker_missing(key)
        sequences = tracker.sequences
        if self._publish is None:
            sequences.free(request_id)
            return
        where = sequences.worker_of(request_id)
        if where is None:
            return
        sequences.free(request_id)
        self._publish(key, tracker.block_size, Op.FREE, request_id, where[0], where[1], (), 0)

    def expire_stale(self) -> int:
        """Free stale requests in every tracker (the periodic sweep); returns how many."""
        return sum(len(t.sequences.expire_stale()) for t in self._trackers.values())

    # ----------------------------------------------------------------- queries

    def loads(self, model_name: str | None, tenant_id: str | None) -> list[LoadInfo]:
        out = [
            LoadInfo(
                key[0],
                key[1],
                load.worker_id,
                load.dp_rank,
                load.active_prefill_tokens,
                load.active_decode_blocks,
            )
            for key, tracker in self._matching(model_name, tenant_id)
            for load in tracker.sequences.active_loads()
        ]
        out.sort(key=lambda x: (x.model_name, x.tenant_id, x.worker_id, x.dp_rank))
        return out

    def potential_loads(
        self, key: TrackerKey, sequence_hashes: Iterable[int] | BlockCounts, new_isl_tokens: int
    ) -> list[PotentialLoad]:
        tracker = self._trackers.get(key)
        if tracker is None:
            raise _tracker_missing(key)
        return tracker.sequences.potential_loads(sequence_hashes, new_isl_tokens)

    def sequences(self, key: TrackerKey) -> ActiveSequences | None:
        """The tracker's accounting (for tests and invariant checks)."""
        tracker = self._trackers.get(key)
        return None if tracker is None else tracker.sequences

    def check_invariants(self) -> None:
        for key, tracker in self._trackers.items():
            tracker.sequences.check_invariants()
            expected = {(w, r) for w, (s, n) in tracker.workers.items() for r in range(s, s + n)}
            if set(tracker.sequences.ranks()) != expected or not tracker.workers:
                raise AssertionError(f"tracker {key}: ranks disagree with registrations")

    # ----------------------------------------------------------------- replica

    def apply_replica(
        self,
        key: TrackerKey,
        block_size: int,
        op: int,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int,
    ) -> bool:
        """Apply a peer's lifecycle event; returns False when it is dropped.

        Dropped: unknown (model_name, tenant_id), other block size, unknown worker or rank, a
        duplicate add, or a prefill_complete/free for a request this replica does not hold on
        that rank. Never creates workers and never publishes.
        """
        tracker = self._trackers.get(key)
        applied = False
        if (
            tracker is not None
            and tracker.block_size == block_size
            and tracker.sequences.has_rank(worker_id, dp_rank)
        ):
            sequences = tracker.sequences
            if op == Op.ADD:
                if request_id not in sequences:
                    sequences.add_request(
                        request_id,
                        worker_id,
                        dp_rank,
                        sequence_hashes,
                        new_isl_tokens=new_isl_tokens,
                    )
                    applied = True
            elif sequences.worker_of(request_id) == (worker_id, dp_rank):
                if op == Op.FREE:
                    applied = sequences.free(request_id)
                elif op == Op.PREFILL_COMPLETE:
                    applied = sequences.mark_prefill_completed(request_id)
        if applied:
            self.replica_applied += 1
        else:
            self.replica_dropped += 1
        return applied

    def _matching(
        self, model_name: str | None, tenant_id: str | None
    ) -> list[tuple[TrackerKey, _Tracker]]:
        return [
            (key, tracker)
            for key, tracker in self._trackers.items()
            if (model_name is None or key[0] == model_name)
            and (tenant_id is None or key[1] == tenant_id)
        ]

"""Approximate prefix index for ``--no-kv-events`` (FACTS §3.2): the router records its own routing
decisions as cached on the chosen (worker, dp_rank), and forgets them after a TTL (120 s default).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

from dynamo.router.hashing import sequence_hashes
from dynamo.router.radix_tree import RadixTree
from dynamo.router.slots import SlotMap, WorkerKey

DEFAULT_TTL_S = 120.0


class ApproxIndex:
    """A TTL'd prefix index of routing decisions.

    Each block of a recorded request is stored under its *sequence* hash as external id (unique per
    prefix), with expiry ``now + ttl``; recording again refreshes every block on the path. Since a
    record always covers a whole root path, a block never outlives its parent, so expired entries
    form whole subtrees: :meth:`prune` pops due records from a heap and drops, from each record's
    last block upwards, the highest still-expired block (its subtree goes with it).

    Expiry is lazy: :meth:`find_matches` and :meth:`record` prune first; the owner may also call
    :meth:`prune` periodically to bound memory. ``clock`` is injectable (tests). Single owner.
    """

    def __init__(
        self, ttl_s: float = DEFAULT_TTL_S, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.ttl_s = ttl_s
        self._clock = clock
        self._tree = RadixTree()
        self._slots = SlotMap()
        self._expiry: dict[int, dict[int, float]] = {}  # slot -> seq hash -> expiry
        self._heap: list[tuple[float, int, int, list[int]]] = []  # (expiry, seq, slot, seq hashes)
        self._seq = itertools.count()

    def record(
        self,
        worker_id: int,
        dp_rank: int,
        local_hashes: Sequence[int],
        seq_hashes: Sequence[int] | None = None,
    ) -> None:
        """Mark the request's blocks as cached on (worker_id, dp_rank) until now + ttl.

        ``seq_hashes`` (the chained hashes of ``local_hashes``) may be passed if already computed.
        """
        if not local_hashes:
            return
        seqs = list(seq_hashes) if seq_hashes is not None else sequence_hashes(local_hashes)
        if len(seqs) != len(local_hashes):
            raise ValueError("seq_hashes and local_hashes differ in length")
        now = self._clock()
        self.prune(now)
        slot = self._slots.slot((worker_id, dp_rank))
        tree = self._tree
        if not tree.holds(slot, seqs[-1]):
            # held blocks form a prefix: store only the part after the longest held one
            lo, hi = 0, len(seqs) - 1  # seqs[:lo] held; seqs[hi] not held
            while lo < hi:
                mid = (lo + hi) // 2
                if tree.holds(slot, seqs[mid]):
                    lo = mid + 1
                else:
                    hi = mid
            parent = seqs[lo - 1] if lo else None
            tree.store_hashes(slot, parent, seqs[lo:], list(local_hashes[lo:]))
        expiry = now + self.ttl_s
        exp = self._expiry.setdefault(slot, {})
        for s in seqs:
            exp[s] = expiry
        heapq.heappush(self._heap, (expiry, next(self._seq), slot, seqs))

    def find_matches(self, local_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """(worker_id, dp_rank) -> leading blocks recorded there and not yet expired."""
        self.prune(self._clock())
        return self._slots.to_keys(self._tree.find_matches(local_hashes))

    def prune(self, now: float | None = None) -> int:
        """Drop every entry with expiry <= ``now`` (default: the clock). Returns blocks dropped."""
        if now is None:
            now = self._clock()
        heap = self._heap
        dropped = 0
        while heap and heap[0][0] <= now:
            _, _, slot, seqs = heapq.heappop(heap)
            exp = self._expiry.get(slot)
            if exp is None:
                continue
            top = None
            for s in reversed(seqs):
                e = exp.get(s)
                if e is None or e > now:  # already gone, or refreshed by a later record
                    break
                top = s
            if top is None:
                continue
            removed: list[int] = []
            self._tree.remove(slot, (top,), removed)
            for s in removed:
                del exp[s]
            dropped += len(removed)
        return dropped

    def remove_worker(self, worker_id: int) -> None:
        """Forget every rank of a worker (it left discovery)."""
        for key in [k for k in self._slots.keys() if k[0] == worker_id]:
            self.clear(*key)
            self._slots.release(key)

    def clear(self, worker_id: int, dp_rank: int = 0) -> None:
        slot = self._slots.get((worker_id, dp_rank))
        if slot is not None:
            self._tree.clear(slot)
            self._expiry.pop(slot, None)
            # heap entries of this slot now find nothing and are skipped

    def num_blocks(self, worker_id: int, dp_rank: int = 0) -> int:
        slot = self._slots.get((worker_id, dp_rank))
        return 0 if slot is None else self._tree.num_blocks(slot)

    @property
    def num_nodes(self) -> int:
        return self._tree.num_nodes

    def check_invariants(self) -> None:
        self._tree.check_invariants()
        for slot in self._tree.slots():
            n = len(self._expiry.get(slot, {}))
            if n != self._tree.num_blocks(slot):
                raise AssertionError(f"slot {slot}: {n} expiries for {self._tree.num_blocks(slot)}")

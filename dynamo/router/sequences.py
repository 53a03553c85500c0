"""Active load per (worker_id, dp_rank): the one load-accounting implementation (FACTS §5).

The KV router and the standalone slot tracker both keep their in-flight requests here. Pure
in-process state: no I/O, no locks; one owner (a task or a handler) calls it.

Block identity is positional, as in the reference (FACTS §5.1): an active block is a node of
the trie of the rank's active sequences, named by its whole prefix. A query block counts as
already active only when the query's prefix up to it is a prefix of an active request on that
rank. Each node is held as a chained 64-bit prefix key (``BlockCounts.add_prefixes``), so the
trie is a flat refcounted multiset of keys and "blocks not in the trie" is one probe per block.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from dynamo import native
from dynamo.router.block_counts import BlockCounts, new_blocks, new_blocks_of_keys
from dynamo.router.loads import ActiveLoad, LoadProjection, PotentialLoad
from dynamo.router.sequences_check import check_sequences

log = logging.getLogger(__name__)

# a request's load in and out (add_routed, mark_prefill_completed, free): C, or its Python twin
_active = native.load("dynamo.router._active", "dynamo.router._active_fallback")
ACTIVE_IMPLEMENTATION: str = _active.__name__
if TYPE_CHECKING:
    from dynamo.router._active import add_routed, free, mark_prefill_completed
else:
    add_routed, free, mark_prefill_completed = (
        _active.add_routed,
        _active.free,
        _active.mark_prefill_completed,
    )

__all__ = ["ActiveLoad", "ActiveSequences", "DuplicateRequest", "LoadProjection"]
__all__ += ["PotentialLoad", "UnknownWorkerRank", "WorkerRank", "add_routed", "free"]
__all__ += ["mark_prefill_completed"]

WorkerRank = tuple[int, int]
"""``(worker_id, dp_rank)``."""

DEFAULT_EXPIRY_S = 300.0
"""Requests older than this are freed as stale (``DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS``)."""
EXPIRY_CHECK_INTERVAL_S = 30.0
"""Stale requests are looked for at most this often, on ``add_request``."""


class DuplicateRequest(ValueError):
    """``add_request`` with a request id that is already active."""


class UnknownWorkerRank(LookupError):
    """``add_request`` on a (worker_id, dp_rank) that was never added (or was removed)."""


def _length(sequence_hashes: Iterable[int] | BlockCounts) -> int:
    """Blocks in the request, repeats included (no reuse: each block is its own)."""
    if isinstance(sequence_hashes, BlockCounts):
        return sum(count for _, count in sequence_hashes.items())
    if isinstance(sequence_hashes, Collection):
        return len(sequence_hashes)
    return sum(1 for _ in sequence_hashes)


@dataclass(slots=True, eq=False)
class _Rank:
    worker_id: int
    dp_rank: int
    # The trie of active sequences: prefix key of each active node -> number of active requests
    # whose sequence passes through it (native: the projection probes it for every query block
    # of every routing decision).
    blocks: BlockCounts = field(default_factory=BlockCounts)
    # Blocks that are never shared (assume_kv_reuse=False): counted, not materialised.
    private_blocks: int = 0
    prefill_tokens: int = 0
    num_requests: int = 0
    column: int = 0  # its place in the rank list (and ActiveSequences' load columns)


class _Request(msgspec.Struct, gc=False):
    # A Struct (not a dataclass): created on every add, and Struct.__init__ runs in C.
    rank: _Rank
    keys: bytes  # the prefix keys of its blocks (prefix_key_bytes); empty without KV reuse
    private_blocks: int
    prefill_tokens: int  # 0 once prefill completed
    started_at: float


class ActiveSequences:
    """In-flight requests and the load they put on each (worker_id, dp_rank).

    Per rank: the active prompt blocks as the nodes of a trie of the active sequences
    (refcounted, so requests sharing a prefix on one rank count it once; a block hash seen at a
    different position or after a different prefix is a different block), the prefill tokens
    of requests whose prefill has not finished, and the number of active requests.

    Lifecycle: ``add_request`` (touch each block, add prefill tokens) -> ``mark_prefill_completed``
    (first token: prefill tokens leave, blocks stay) -> ``free`` (end, error or cancel: everything
    leaves; trie nodes whose refcount drops to 0 leave the active set). Requests are kept in arrival
    order; requests older than ``expiry_s`` are freed as stale (looked for at most every
    ``expiry_check_interval_s``, on ``add_request``, or when ``expire_stale`` is called).

    ``assume_kv_reuse=False`` (disaggregated decode: transferred blocks are not shared) counts
    every block of every request as distinct, exactly as if each block had a fresh random hash;
    the hashes are then only used for their number.

    Hashes are opaque integers: the slot tracker passes the signed 64-bit values it received, the
    router the unsigned ones from ``router.hashing``. Never mix both forms in one instance.

    Not thread-safe; calls must come from one thread (the event loop).
    """

    __slots__ = (
        "_block_size",
        "_assume_kv_reuse",
        "_expiry_s",
        "_check_interval_s",
        "_clock",
        "_next_check",
        "_ranks",
        "_rank_list",
        "_requests",
        "_columns_for",
        "_columns",
        "_stale",
    )

    def __init__(
        self,
        block_size: int,
        *,
        assume_kv_reuse: bool = True,
        expiry_s: float = DEFAULT_EXPIRY_S,
        expiry_check_interval_s: float = EXPIRY_CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if expiry_s <= 0 or expiry_check_interval_s < 0:
            raise ValueError("expiry_s must be positive and expiry_check_interval_s >= 0")
        self._block_size = block_size
        self._assume_kv_reuse = assume_kv_reuse
        self._expiry_s = expiry_s
        self._check_interval_s = expiry_check_interval_s
        self._clock = clock
        self._next_check = clock() + expiry_check_interval_s
        self._ranks: dict[WorkerRank, _Rank] = {}
        self._rank_list: list[_Rank] = []  # iteration order of the load queries
        self._requests: dict[str, _Request] = {}  # insertion order == arrival order
        # rank_loads' last ``keys`` (the router's, until its membership changes): their ranks,
        # block tables, and whether they are every rank in order; reset when ranks come or go.
        self._columns_for: (
            tuple[Sequence[WorkerRank], list[_Rank], list[BlockCounts], bool] | None
        ) = None
        # Every rank's prefill tokens, decode blocks and requests in rank-list order, kept up to
        # date lazily: a rank that changed is noted in _stale (by column) until the next query.
        self._columns: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._stale: dict[int, _Rank] = {}

    # ---------------------------------------------------------------- topology

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def assume_kv_reuse(self) -> bool:
        return self._assume_kv_reuse

    def add_worker(self, worker_id: int, dp_ranks: Iterable[int] = (0,)) -> None:
        """Start tracking these ranks of ``worker_id`` (ranks already tracked stay as they are)."""
        for dp_rank in dp_ranks:
            key = (worker_id, dp_rank)
            if key not in self._ranks:
                rank = _Rank(worker_id, dp_rank)
                self._ranks[key] = rank
                self._rank_list.append(rank)
                self._rebuild_columns()

    def remove_worker(self, worker_id: int, dp_ranks: Iterable[int] | None = None) -> list[str]:
        """Stop tracking ``worker_id`` (all its ranks, or only ``dp_ranks``); frees its requests.

        Returns the ids of the requests that were freed, in arrival order.
        """
        if dp_ranks is None:
            gone = {rank for rank in self._rank_list if rank.worker_id == worker_id}
        else:
            gone = {r for d in dp_ranks if (r := self._ranks.get((worker_id, d))) is not None}
        if not gone:
            return []
        freed = [rid for rid, req in self._requests.items() if req.rank in gone]
        for rid in freed:
            self.free(rid)
        for rank in gone:
            del self._ranks[(rank.worker_id, rank.dp_rank)]
        self._rank_list = [rank for rank in self._rank_list if rank not in gone]
        self._rebuild_columns()
        return freed

    def _rebuild_columns(self) -> None:
        """The rank list changed: number its ranks, rebuild the columns, drop load_columns'
        resolved keys."""
        ranks = self._rank_list
        for i, rank in enumerate(ranks):
            rank.column = i
        self._columns = (
            [rank.prefill_tokens for rank in ranks],
            [len(rank.blocks) + rank.private_blocks for rank in ranks],
            [rank.num_requests for rank in ranks],
        )
        self._stale = {}
        self._columns_for = None

    @property
    def resolved(self) -> object:
        """rank_loads' resolved keys: the same object while its ranks stay valid."""
        return self._columns_for

    def has_rank(self, worker_id: int, dp_rank: int) -> bool:
        return (worker_id, dp_rank) in self._ranks

    def ranks(self) -> list[WorkerRank]:
        """Tracked (worker_id, dp_rank) pairs, in the order they were added."""
        return [(rank.worker_id, rank.dp_rank) for rank in self._rank_list]

    # --------------------------------------------------------------- lifecycle

    def add_request(
        self,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Sequence[int],
        *,
        new_isl_tokens: int = 0,
        overlap_blocks: int = 0,
        prefix_keys: bytes | None = None,
    ) -> None:
        """Record a request routed to (worker_id, dp_rank).

        ``sequence_hashes``: one hash per prompt block (may be empty). Prefill load added:
        ``max(0, new_isl_tokens - overlap_blocks * block_size)``; pass ``new_isl_tokens=0`` when
        prefill tokens are not tracked. ``prefix_keys``: ``prefix_key_bytes(sequence_hashes)``
        when the caller computed it already (the router's route did: its blocks are then not
        chained again). Raises DuplicateRequest or UnknownWorkerRank (and then changes nothing).
        """
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} is already active")
        rank = self._ranks.get((worker_id, dp_rank))
        if rank is None:
            raise UnknownWorkerRank(f"worker {worker_id} dp_rank {dp_rank} is not registered")
        self.add_routed(
            request_id, rank, sequence_hashes, new_isl_tokens, overlap_blocks, prefix_keys
        )

    def add_routed(
        self,
        request_id: str,
        rank: _Rank,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int,
        overlap_blocks: int,
        prefix_keys: bytes | None,
    ) -> bool:
        """``add_request`` on a rank of :meth:`rank_loads` (the router's choice: no lookup);
        False, changing nothing, if the id is already active."""
        return add_routed(
            self, request_id, rank, sequence_hashes, new_isl_tokens, overlap_blocks, prefix_keys
        )

    def mark_prefill_completed(self, request_id: str) -> bool:
        """The request's first token was seen: its prefill tokens leave; its blocks stay.

        Returns False for an unknown request; a repeat is a no-op that returns True.
        """
        return mark_prefill_completed(self, request_id)

    def free(self, request_id: str) -> bool:
        """The request ended (finished, failed or cancelled): release everything it held.

        Returns False (and does nothing) for an unknown request.
        """
        return free(self, request_id)

    def expire_stale(self, now: float | None = None) -> list[str]:
        """Free every request added more than ``expiry_s`` ago; returns their ids."""
        if now is None:
            now = self._clock()
        self._next_check = now + self._check_interval_s
        cutoff = now - self._expiry_s
        stale: list[str] = []
        for request_id, req in self._requests.items():  # oldest first
            if req.started_at > cutoff:
                break
            stale.append(request_id)
        for request_id in stale:
            self.free(request_id)
        if stale:
            log.warning("freed %d stale request(s) older than %.0f s", len(stale), self._expiry_s)
        return stale

    # ----------------------------------------------------------------- queries

    def potential_loads(
        self, sequence_hashes: Iterable[int] | BlockCounts, new_isl_tokens: int = 0
    ) -> list[PotentialLoad]:
        """Each tracked rank's load if a request with these blocks and tokens were added there.

        Read-only. One entry per rank, in the order the ranks were added. A query block is new
        on a rank unless its whole prefix is active there; a prepared query may be passed as a
        ``BlockCounts`` of prefix keys (``BlockCounts.of_prefixes`` / ``prefixes_from_json``).
        """
        load = PotentialLoad
        return [
            load(
                rank.worker_id,
                rank.dp_rank,
                rank.prefill_tokens + new_isl_tokens,
                len(rank.blocks) + rank.private_blocks + new_blocks,
                rank.num_requests,
            )
            for rank, new_blocks in zip(
                self._rank_list, self._new_blocks(sequence_hashes), strict=True
            )
        ]

    def project_loads(self, sequence_hashes: Iterable[int] | BlockCounts) -> list[LoadProjection]:
        """Each tracked rank's load, split as the router's cost needs it. Read-only.

        Same numbers as ``potential_loads`` without the new request's prefill tokens:
        ``potential_decode_blocks == active_decode_blocks + new_decode_blocks``.
        """
        proj = LoadProjection
        return [
            proj(
                rank.worker_id,
                rank.dp_rank,
                rank.prefill_tokens,
                len(rank.blocks) + rank.private_blocks,
                new_blocks,
                rank.num_requests,
            )
            for rank, new_blocks in zip(
                self._rank_list, self._new_blocks(sequence_hashes), strict=True
            )
        ]

    def load_columns(
        self,
        sequence_hashes: Sequence[int],
        keys: Sequence[WorkerRank],
        prefix_keys: bytes | None = None,
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """``project_loads`` as columns, for the tracked ranks ``keys`` in that order (KeyError
        for one that is not tracked): active prefill tokens, active decode blocks, the
        request's blocks new there, active requests. Read-only.

        ``keys`` is resolved once and reused while the caller passes the same list object and
        no rank comes or goes: the caller must not mutate it in place. ``keys`` in the order the
        ranks were added (the router's targets): copies of columns kept up to date per change."""
        ranks, new, whole = self.rank_loads(sequence_hashes, keys, prefix_keys)
        if whole:  # every rank in rank-list order: the kept columns
            prefill, decode, requests = self._columns
            for i, rank in self._stale.items():
                prefill[i] = rank.prefill_tokens
                decode[i] = len(rank.blocks) + rank.private_blocks
                requests[i] = rank.num_requests
            self._stale.clear()
            return prefill[:], decode[:], new, requests[:]
        return (
            [rank.prefill_tokens for rank in ranks],
            [len(rank.blocks) + rank.private_blocks for rank in ranks],
            new,
            [rank.num_requests for rank in ranks],
        )

    def rank_loads(
        self,
        sequence_hashes: Sequence[int],
        keys: Sequence[WorkerRank],
        prefix_keys: bytes | None = None,
    ) -> tuple[list[_Rank], list[int], bool]:
        """The ranks ``keys`` (``load_columns``' contract) as the route kernel reads them
        (``router/_route.pyi``), the request's blocks new on each, and whether they are every
        rank in rank-list order. Read-only. ``prefix_keys``: as ``add_request``'s."""
        cached = self._columns_for
        if cached is not None and cached[0] is keys:
            ranks, tables, whole = cached[1], cached[2], cached[3]
        else:
            table, listed = self._ranks, self._rank_list
            ranks = [table[key] for key in keys]
            tables = [rank.blocks for rank in ranks]
            whole = len(ranks) == len(listed) and all(map(operator.is_, ranks, listed))
            self._columns_for = (keys, ranks, tables, whole)
        if self._assume_kv_reuse:
            # the rank's trie holds whole paths: the request's blocks past its deepest node
            if prefix_keys is not None:
                return ranks, new_blocks_of_keys(tables, prefix_keys), whole
            return ranks, new_blocks(tables, sequence_hashes), whole
        return ranks, [len(sequence_hashes)] * len(ranks), whole

    def _new_blocks(self, sequence_hashes: Iterable[int] | BlockCounts) -> list[int]:
        """Per rank (in order), the request's blocks that would be new there.

        With KV reuse: its blocks whose prefix is not a trie node of the rank. Without: all of
        its blocks (none are shared), the same for every rank.
        """
        if self._assume_kv_reuse:
            query = (
                sequence_hashes
                if isinstance(sequence_hashes, BlockCounts)
                else BlockCounts.of_prefixes(sequence_hashes)
            )
            return [rank.blocks.count_absent(query) for rank in self._rank_list]
        return [_length(sequence_hashes)] * len(self._rank_list)

    def active_loads(self) -> list[ActiveLoad]:
        """Each tracked rank's current load, in the order the ranks were added."""
        return [
            ActiveLoad(
                rank.worker_id,
                rank.dp_rank,
                rank.prefill_tokens,
                len(rank.blocks) + rank.private_blocks,
                rank.num_requests,
            )
            for rank in self._rank_list
        ]

    def active_prefill_tokens(self, worker_id: int, dp_rank: int = 0) -> int:
        """Prefill tokens of the rank's requests whose prefill has not completed (0 if unknown)."""
        rank = self._ranks.get((worker_id, dp_rank))
        return rank.prefill_tokens if rank is not None else 0

    def active_decode_blocks(self, worker_id: int, dp_rank: int = 0) -> int:
        """Active blocks on the rank: trie nodes (+ private blocks) (0 if unknown)."""
        rank = self._ranks.get((worker_id, dp_rank))
        return len(rank.blocks) + rank.private_blocks if rank is not None else 0

    def active_requests(self, worker_id: int, dp_rank: int = 0) -> int:
        """Active requests on the rank (0 if unknown)."""
        rank = self._ranks.get((worker_id, dp_rank))
        return rank.num_requests if rank is not None else 0

    def worker_of(self, request_id: str) -> WorkerRank | None:
        """Where an active request runs, or None."""
        req = self._requests.get(request_id)
        return None if req is None else (req.rank.worker_id, req.rank.dp_rank)

    def is_prefill_pending(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        return req is not None and req.prefill_tokens > 0

    def request_ids(self) -> list[str]:
        """Active request ids in arrival order."""
        return list(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Recompute every per-rank figure from the requests; raise AssertionError on a mismatch."""
        check_sequences(self)

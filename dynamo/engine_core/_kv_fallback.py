"""Pure-Python twin of ``dynamo.engine_core._kv`` (contract: ``_kv.pyi``): the KV block manager
of one DP rank, used where the extension is not built or ``DYN_NATIVE=0``. Import ``KVManager``
through ``dynamo.engine_core.kv_manager``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dynamo.protocol.kv_events import (
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    KVCacheEventData,
    StoredBlock,
)
from dynamo.protocol.kv_raw import encode


class KVManager:
    """Blocks of one DP rank. Not thread-safe: owned by one scheduler (one task).

    Two kinds of block occupy the ``num_blocks`` slots:

    * full blocks, keyed by their sequence hash (FACTS §1.2) and shareable. In use they sit in
      ``active`` with a refcount; at refcount 0 they move to the ``inactive`` LRU pool, still
      cached, until evicted to make room (a ``Removed`` event). A full block entering the cache
      produces a ``Stored`` event (``block_hash`` = sequence hash, ``tokens_hash`` = local hash).
    * unique blocks, private to one sequence: its growing tail, or all its blocks when prefix
      caching is off. Their id *is* their slot. They produce no events; a tail becomes full via
      ``promote``.

    Every block occupies one physical slot in ``[0, num_blocks)`` (``slot_of`` for a full block;
    a unique block's id is its slot): a full block keeps its slot while cached (active or
    inactive) and frees it on eviction. With prefix caching off no full block ever exists, so no
    event is ever produced.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        dp_rank: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.dp_rank = dp_rank
        self.enable_prefix_caching = enable_prefix_caching
        self._active: dict[int, int] = {}
        self._inactive: OrderedDict[int, None] = OrderedDict()
        self._unique: set[int] = set()
        self._slots: dict[int, int] = {}  # full block hash -> its slot
        self._locals: dict[int, int] = {}  # full block hash -> its local (tokens) hash
        # Cached blocks never announced (received from a prefill worker): their eviction is not
        # announced either, so routers only ever hear of blocks this rank computed.
        self._silent: set[int] = set()
        # Free slots, popped from the end: lowest ids first, so a fresh pool fills in order.
        self._free_slots: list[int] = list(range(num_blocks - 1, -1, -1))
        self._events: list[KVCacheEvent] = []
        self._next_event_id = 0
        self._raw = False

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_active_blocks(self) -> int:
        """Blocks in use by some sequence (full + unique)."""
        return len(self._active) + len(self._unique)

    @property
    def num_inactive_blocks(self) -> int:
        return len(self._inactive)

    @property
    def num_available_blocks(self) -> int:
        """Slots a new block can take: free ones plus evictable inactive ones."""
        return self.num_blocks - self.num_active_blocks

    def slot_of(self, block_hash: int) -> int:
        """The physical slot of a cached full block (``KeyError`` if it is not cached)."""
        return self._slots[block_hash]

    def local_hash_of(self, block_hash: int) -> int:
        """The local (tokens) hash of a cached full block (``KeyError`` if not cached)."""
        return self._locals[block_hash]

    def block_table(self, full_blocks: Sequence[int], unique_blocks: Sequence[int]) -> list[int]:
        """Slots of a sequence's blocks, in token order (its full blocks lead, as in
        ``Sequence``)."""
        slots = self._slots
        return [slots[h] for h in full_blocks] + list(unique_blocks)

    def refcount(self, block_hash: int) -> int:
        return self._active.get(block_hash, 0)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._active or block_hash in self._inactive

    def cached_blocks(self) -> set[int]:
        """Every full block the cache holds (active or inactive): what KV events describe."""
        return set(self._active) | set(self._inactive)

    def num_cached_prefix(self, block_hashes: Sequence[int]) -> int:
        """Length of the longest run of leading blocks present (active or inactive)."""
        if not self.enable_prefix_caching:
            return 0
        active, inactive = self._active, self._inactive
        n = 0
        for h in block_hashes:
            if h not in active and h not in inactive:
                break
            n += 1
        return n

    def num_slots_needed(self, block_hashes: Sequence[int], num_unique: int) -> int:
        """Available slots that ``use(block_hashes)`` + ``num_unique`` unique blocks would take
        (already-active blocks take none)."""
        return self._count_missing(block_hashes) + num_unique

    # -- mutations --------------------------------------------------------------------------
    def use(
        self, block_hashes: Sequence[int], local_hashes: Sequence[int], *, announce: bool = True
    ) -> None:
        """Reference the chain ``block_hashes`` (a sequence's leading full blocks, in order).

        Active blocks gain a reference; inactive ones are revived; missing ones are stored
        (evicting LRU inactive blocks for room) and announced, one ``Stored`` event per run of
        consecutive new blocks with ``parent_hash`` = the block before the run. Raises
        ``RuntimeError`` if there is no room: callers check ``num_slots_needed`` first.

        ``announce=False`` (a decode worker's blocks received from a prefill worker): the new
        blocks are cached but produce no event, now or when they are evicted.
        """
        if not self.enable_prefix_caching:
            raise RuntimeError("full blocks are not used when prefix caching is off")
        if self._count_missing(block_hashes) > self.num_available_blocks:
            raise RuntimeError("not enough KV blocks")
        # First pin every block we already have, so eviction below never takes one of ours.
        active, inactive = self._active, self._inactive
        new: list[int] = []
        for i, h in enumerate(block_hashes):
            if h in active:
                active[h] += 1
            elif h in inactive:
                del inactive[h]
                active[h] = 1
            else:
                new.append(i)
        self._make_room(len(new))
        run: list[StoredBlock] = []
        for k, i in enumerate(new):
            self._active[block_hashes[i]] = 1
            self._slots[block_hashes[i]] = self._free_slots.pop()
            self._locals[block_hashes[i]] = local_hashes[i]
            if not announce:
                self._silent.add(block_hashes[i])
                continue
            run.append(StoredBlock(block_hash=block_hashes[i], tokens_hash=local_hashes[i]))
            if k + 1 == len(new) or new[k + 1] != i + 1:
                start = i + 1 - len(run)
                parent = block_hashes[start - 1] if start > 0 else None
                self._emit(BlocksStored(parent_hash=parent, blocks=run))
                run = []

    def allocate_unique(self, n: int) -> list[int] | None:
        """``n`` private blocks, or None (nothing changed) if there is no room."""
        if n > self.num_available_blocks:
            return None
        self._make_room(n)
        free = self._free_slots
        ids = free[: -n - 1 : -1] if n else []  # popped from the end: the last n, reversed
        del free[len(free) - n :]
        self._unique.update(ids)
        return ids

    def promote(self, unique_id: int, block_hash: int, local_hash: int, parent: int | None) -> None:
        """A private tail block filled up: it becomes the full block ``block_hash``.

        If that block is already cached the private copy collapses onto it (no event; its slot
        is freed: the cached copy holds the same KV); otherwise it is stored, in the same slot,
        and announced with its parent.
        """
        self.promote_run([unique_id], [block_hash], [local_hash], parent)

    def promote_run(
        self,
        unique_ids: Sequence[int],
        block_hashes: Sequence[int],
        local_hashes: Sequence[int],
        parent: int | None,
    ) -> None:
        """``promote`` consecutive blocks of one chain (``parent`` precedes the first), with one
        ``Stored`` event per run of newly stored blocks, as ``use`` announces them."""
        run: list[StoredBlock] = []
        run_parent = parent
        for unique_id, h, local in zip(unique_ids, block_hashes, local_hashes, strict=True):
            self._unique.remove(unique_id)
            if h in self._active or h in self._inactive:
                if h in self._active:
                    self._active[h] += 1
                else:
                    del self._inactive[h]
                    self._active[h] = 1
                self._free_slots.append(unique_id)
                if run:
                    self._emit(BlocksStored(parent_hash=run_parent, blocks=run))
                    run = []
                run_parent = h
                continue
            self._active[h] = 1
            self._slots[h] = unique_id
            self._locals[h] = local
            run.append(StoredBlock(block_hash=h, tokens_hash=local))
        if run:
            self._emit(BlocksStored(parent_hash=run_parent, blocks=run))

    def release(self, block_hashes: Sequence[int], unique_ids: Sequence[int]) -> None:
        """Drop one reference to each full block and free the private blocks.

        Full blocks are released tail first, so that within a chain the leaves become the least
        recently used and are evicted before their parents.
        """
        unique = self._unique
        if not unique.issuperset(unique_ids):
            raise KeyError("releasing a private block that is not allocated")
        unique.difference_update(unique_ids)
        self._free_slots.extend(unique_ids)
        active, inactive = self._active, self._inactive
        for h in reversed(block_hashes):
            rc = active[h] - 1
            if rc:
                active[h] = rc
            else:
                del active[h]
                inactive[h] = None

    def drain_events(self) -> list[KVCacheEvent]:
        """Events produced since the last drain, in order (the engine publishes them per pass)."""
        if self._raw:
            raise RuntimeError("this KV manager records raw events: drain_raw_events")
        events, self._events = self._events, []
        return events

    @property
    def raw_events(self) -> bool:
        return self._raw

    def record_raw_events(self) -> None:
        """From now on record the events in the raw form (``dynamo.protocol.kv_raw``)."""
        if self._events:
            raise RuntimeError("drain the pending events first")
        if not 0 <= self.dp_rank < 1 << 64:
            raise ValueError("raw events need a dp_rank in [0, 2**64)")
        self._raw = True

    def drain_raw_events(self) -> bytes:
        """The raw form of the events since the last drain (``b""``: none)."""
        if not self._raw:
            raise RuntimeError("this KV manager does not record raw events")
        events, self._events = self._events, []
        return encode(events)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pools are inconsistent."""
        assert all(rc > 0 for rc in self._active.values()), "non-positive refcount"
        assert not (self._active.keys() & self._inactive.keys()), "block both active and inactive"
        used = len(self._active) + len(self._unique) + len(self._inactive)
        assert used <= self.num_blocks, f"{used} blocks > capacity {self.num_blocks}"
        assert used + len(self._free_slots) == self.num_blocks, "leaked slots"
        assert self._slots.keys() == self._active.keys() | self._inactive.keys(), "slotless block"
        assert self._locals.keys() == self._slots.keys(), "block without its local hash"
        assert self._silent <= self._slots.keys(), "silent block not cached"
        taken = [*self._slots.values(), *self._unique, *self._free_slots]
        assert len(set(taken)) == self.num_blocks == len(taken), "slot used twice"
        if not self.enable_prefix_caching:
            assert not self._active and not self._inactive, "full blocks with caching off"

    # -- internals --------------------------------------------------------------------------
    def _count_missing(self, block_hashes: Sequence[int]) -> int:
        active = self._active
        return sum(1 for h in block_hashes if h not in active)

    def _make_room(self, n: int) -> None:
        """Evict LRU inactive blocks until ``n`` slots are free (one Removed event)."""
        free = self.num_blocks - self.num_active_blocks - len(self._inactive)
        if free >= n:
            return
        inactive, slots, locals_, silent = self._inactive, self._slots, self._locals, self._silent
        evicted: list[int] = []
        for _ in range(n - free):
            h, _ = inactive.popitem(last=False)
            self._free_slots.append(slots.pop(h))
            del locals_[h]
            if h in silent:
                silent.discard(h)
            else:
                evicted.append(h)
        if evicted:
            self._emit(BlocksRemoved(block_hashes=evicted))

    def _emit(self, data: KVCacheEventData) -> None:
        self._events.append(
            KVCacheEvent(event_id=self._next_event_id, data=data, dp_rank=self.dp_rank)
        )
        self._next_event_id += 1

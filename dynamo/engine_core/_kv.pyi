"""Type stub of the native module ``dynamo.engine_core._kv`` (source: ``_kv.c``; the same
contract in Python: ``_kv_fallback.py``). Import through ``dynamo.engine_core.kv_manager``."""

from collections.abc import Sequence

from dynamo.protocol.kv_events import KVCacheEvent

class KVManager:
    """Blocks of one DP rank. Not thread-safe: owned by one scheduler (one task).

    Two kinds of block occupy the ``num_blocks`` slots:

    * full blocks, keyed by their sequence hash (FACTS §1.2) and shareable. In use they sit in
      the active set with a refcount; at refcount 0 they move to the inactive LRU pool, still
      cached, until evicted to make room (a ``Removed`` event). A full block entering the cache
      produces a ``Stored`` event (``block_hash`` = sequence hash, ``tokens_hash`` = local hash).
    * unique blocks, private to one sequence: its growing tail, or all its blocks when prefix
      caching is off. Their id *is* their slot. They produce no events; a tail becomes full via
      ``promote``.

    Every block occupies one physical slot in ``[0, num_blocks)`` (``slot_of`` for a full block;
    a unique block's id is its slot): a full block keeps its slot while cached (active or
    inactive) and frees it on eviction. Free slots are taken lowest first from a fresh pool, and
    a freed slot is the next one taken. With prefix caching off no full block ever exists, so no
    event is ever produced. Hashes are 64-bit ints; a chain's hashes are distinct.
    """

    num_blocks: int
    dp_rank: int
    enable_prefix_caching: bool

    def __init__(
        self, num_blocks: int, *, dp_rank: int = 0, enable_prefix_caching: bool = True
    ) -> None:
        """ValueError if ``num_blocks`` <= 0."""
    @property
    def num_active_blocks(self) -> int:
        """Blocks in use by some sequence (full + unique)."""
    @property
    def num_inactive_blocks(self) -> int: ...
    @property
    def num_available_blocks(self) -> int:
        """Slots a new block can take: free ones plus evictable inactive ones."""
    def slot_of(self, block_hash: int) -> int:
        """The physical slot of a cached full block (``KeyError`` if it is not cached)."""
    def local_hash_of(self, block_hash: int) -> int:
        """The local (tokens) hash of a cached full block (``KeyError`` if not cached)."""
    def block_table(self, full_blocks: Sequence[int], unique_blocks: Sequence[int]) -> list[int]:
        """Slots of a sequence's blocks, in token order (its full blocks lead, as in
        ``Sequence``)."""
    def refcount(self, block_hash: int) -> int: ...
    def is_cached(self, block_hash: int) -> bool: ...
    def cached_blocks(self) -> set[int]:
        """Every full block the cache holds (active or inactive): what KV events describe."""
    def num_cached_prefix(self, block_hashes: Sequence[int]) -> int:
        """Length of the longest run of leading blocks present (active or inactive); 0 with
        prefix caching off."""
    def num_slots_needed(self, block_hashes: Sequence[int], num_unique: int) -> int:
        """Available slots that ``use(block_hashes)`` + ``num_unique`` unique blocks would take
        (already-active blocks take none)."""
    def use(
        self, block_hashes: Sequence[int], local_hashes: Sequence[int], *, announce: bool = True
    ) -> None:
        """Reference the chain ``block_hashes`` (a sequence's leading full blocks, in order).

        Active blocks gain a reference; inactive ones are revived; missing ones are stored
        (evicting LRU inactive blocks for room) and announced, one ``Stored`` event per run of
        consecutive new blocks with ``parent_hash`` = the block before the run. Raises
        ``RuntimeError`` if there is no room (callers check ``num_slots_needed`` first) or
        prefix caching is off.

        ``announce=False`` (a decode worker's blocks received from a prefill worker): the new
        blocks are cached but produce no event, now or when they are evicted.
        """
    def allocate_unique(self, n: int) -> list[int] | None:
        """``n`` private blocks, or None (nothing changed) if there is no room."""
    def promote(self, unique_id: int, block_hash: int, local_hash: int, parent: int | None) -> None:
        """A private tail block filled up: it becomes the full block ``block_hash``.

        If that block is already cached the private copy collapses onto it (no event; its slot
        is freed: the cached copy holds the same KV); otherwise it is stored, in the same slot,
        and announced with its parent.
        """
    def promote_run(
        self,
        unique_ids: Sequence[int],
        block_hashes: Sequence[int],
        local_hashes: Sequence[int],
        parent: int | None,
    ) -> None:
        """``promote`` consecutive blocks of one chain (``parent`` precedes the first), with one
        ``Stored`` event per run of newly stored blocks, as ``use`` announces them. KeyError
        for an id that is not a private block."""
    def release(self, block_hashes: Sequence[int], unique_ids: Sequence[int]) -> None:
        """Drop one reference to each full block and free the private blocks (KeyError, and
        nothing changed, if one is not allocated).

        Full blocks are released tail first, so that within a chain the leaves become the least
        recently used and are evicted before their parents. KeyError for a full block that is
        not active (the blocks after it in the chain are released).
        """
    def drain_events(self) -> list[KVCacheEvent]:
        """Events produced since the last drain, in order (the engine publishes them per pass).
        ``RuntimeError`` once the manager records raw events."""
    @property
    def raw_events(self) -> bool:
        """Whether events are recorded in the raw form (``record_raw_events``)."""
    def record_raw_events(self) -> None:
        """From now on record the events in the raw form (``dynamo.protocol.kv_raw``: one
        buffer of words a drain, no object per event or block) for an in-process consumer (the
        offline replay's index); the live engines publish the structs. ``RuntimeError`` if
        events are pending, ``ValueError`` if ``dp_rank`` is not in ``[0, 2**64)``."""
    def drain_raw_events(self) -> bytes:
        """The raw form of the events since the last drain (``b""``: none): exactly
        ``kv_raw.encode`` of what ``drain_events`` would have returned. ``RuntimeError`` unless
        the manager records raw events."""
    def check_invariants(self) -> None:
        """Raise AssertionError if the pools are inconsistent."""

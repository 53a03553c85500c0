"""Type stub of the native module ``dynamo.router._radix`` (source: ``_radix.c``; the same
contract in Python: ``_radix_fallback.py``). Import through ``dynamo.router.radix_tree``."""

from collections.abc import Sequence
from typing import Protocol

from dynamo.protocol.kv_events import BlocksStored

class BlockLike(Protocol):
    @property
    def block_hash(self) -> int: ...
    @property
    def tokens_hash(self) -> int: ...

class RadixTree:
    """A prefix tree of local block hashes; each block records which *slots* hold it.

    A slot is a small int >= 0 the owner allocates per holder (the indexer: one per (worker,
    dp_rank)). Each slot names its blocks by external ids (one per block; storing a new id for a
    block the slot holds replaces the old id). Ids and hashes are 64-bit ints. A slot's blocks
    are prefix-closed (it holds the parent of every block it holds), so a slot's match length
    is where it drops out of a path. Single-threaded: one owner mutates it."""

    def __init__(self) -> None: ...
    @property
    def num_blocks_total(self) -> int:
        """Distinct blocks (prefix paths) in the tree, whoever holds them."""
    @property
    def num_nodes(self) -> int:
        """Runs of a path-compressed tree: consecutive blocks held by the same slots (walks
        the tree: for tests and occasional metrics)."""
    def num_blocks(self, slot: int) -> int:
        """Blocks the slot holds."""
    def digest(self, slot: int) -> tuple[int, int]:
        """(blocks, digest) of the slot's block set: the 64-bit sum of
        ``((h ^ (h >> 31)) * 0x9E3779B97F4A7C15) mod 2**64`` over its external ids ``h``, so two
        indexes holding the same blocks agree whatever order they learnt them in."""
    def slots(self) -> list[int]:
        """The slots holding at least one block (no particular order)."""
    def holds(self, slot: int, block_hash: int) -> bool: ...
    def store(self, slot: int, parent_hash: int | None, blocks: Sequence[BlockLike]) -> bool:
        """Add a chain of blocks (``block_hash``: external id, ``tokens_hash``: local hash)
        under ``parent_hash`` (an id the slot holds; None: the root)."""
    def store_hashes(
        self, slot: int, parent_hash: int | None, block_hashes: list[int], local_hashes: list[int]
    ) -> bool:
        """:meth:`store` with parallel lists of external ids and local hashes (the tree may keep
        the lists: the caller must not modify them afterwards).

        Re-storing a block with its current id is a no-op; an id the slot uses elsewhere is first
        removed there (with its descendants). Returns False when the parent is unknown (nothing
        is stored) or was lost to such a removal (the blocks before it stay stored)."""
    def remove(
        self, slot: int, block_hashes: Sequence[int], removed: list[int] | None = None
    ) -> int:
        """Drop blocks by external id; the slot also loses every descendant of a dropped block.
        Returns how many ids were unknown. ``removed`` (optional) collects every id the slot
        lost (no particular order)."""
    def apply_raw(self, slot: int, raw: bytes) -> tuple[int, int, int]:
        """Apply a raw event buffer (``dynamo.protocol.kv_raw``: a KV manager's events of one
        pass) to the slot, in order, as :meth:`store` / :meth:`remove` of each decoded event
        would. Returns ``(ok, parent_not_found, block_not_found)``: how many events stored or
        removed everything, stored under an unknown parent (False from :meth:`store`) or named
        an unknown id (:meth:`remove` > 0). ``ValueError`` (nothing applied) if it is malformed,
        ``TypeError`` if it is not ``bytes``."""
    def clear(self, slot: int) -> None:
        """Drop every block of the slot."""
    def find_matches(self, local_hashes: Sequence[int]) -> dict[int, int]:
        """slot -> number of leading blocks of ``local_hashes`` the slot holds (absent: 0)."""
    def dump(self, slot: int) -> list[BlocksStored]:
        """The slot's blocks as stored events, parents first; storing them in order into an
        empty slot rebuilds exactly this slot's state."""
    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant is broken (tests call it after each step)."""

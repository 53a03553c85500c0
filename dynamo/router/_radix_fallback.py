"""Pure-Python twin of ``dynamo.router._radix`` (contract: ``_radix.pyi``): the prefix tree of KV
blocks held by workers (FACTS §3.1), used where the extension is not built or ``DYN_NATIVE=0``.
Import through ``dynamo.router.radix_tree``. Pure data: no event ids, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter
from typing import Protocol

from dynamo.protocol.kv_events import BlocksRemoved, BlocksStored, StoredBlock
from dynamo.protocol.kv_raw import decode
from dynamo.router.radix_run import Lookups, Run, common_prefix, index_of

_BLOCK_ID = attrgetter("block_hash")
_TOKENS_HASH = attrgetter("tokens_hash")


class BlockLike(Protocol):
    @property
    def block_hash(self) -> int: ...
    @property
    def tokens_hash(self) -> int: ...


_DIGEST_MUL = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class RadixTree:
    """A path-compressed prefix tree of local block hashes; each run records which *slots* hold it.

    A slot is a small int the owner allocates per holder (the indexer: one per (worker, dp_rank)).
    Each slot names its blocks by external ids (one per block; storing a new id for a block the
    slot holds replaces the old id). Invariants (see :meth:`check_invariants`):

    * a slot holds whole runs; a run no slot holds is unlinked at once (memory follows held blocks);
    * a slot holding a run holds its parent run (prefix-closed), so holder sets only shrink along a
      path; :meth:`find_matches` relies on it: a slot's score is where it drops out;
    * each slot's lookup maps each of its external ids to the run holding it.

    ::

        root ── [a b c] {w1, w2} ─┬─ [d e] {w1}     w1 holds a b c d e, w2 holds a b c x;
                                  └─ [x]   {w2}     find_matches([a, b, c, d]) = {w1: 4, w2: 3}

    Work is per run, not per block (list slices and bulk dict updates), which is what makes a pure
    Python index fast enough. Single-threaded: one owner mutates it; nothing here awaits.
    """

    __slots__ = ("_root", "_lookups", "_blocks")

    def __init__(self) -> None:
        self._root = Run(None, [], {})
        self._lookups: Lookups = {}
        self._blocks = 0

    @property
    def num_blocks_total(self) -> int:
        """Distinct blocks (prefix paths) in the tree, whoever holds them."""
        return self._blocks

    @property
    def num_nodes(self) -> int:
        """Runs in the tree (walks it: for tests and occasional metrics)."""
        return sum(1 for _ in self._walk()) - 1

    def num_blocks(self, slot: int) -> int:
        """Blocks the slot holds."""
        return len(self._lookups.get(slot, ()))

    def digest(self, slot: int) -> tuple[int, int]:
        """(blocks, digest) of the slot's block set: an order-independent 64-bit sum of mixed
        external ids, so two indexes holding the same blocks agree whatever order they learnt
        them in (the router's cache-consistency check). Walks the slot's ids."""
        lookup = self._lookups.get(slot, {})
        total = 0
        for h in lookup:
            total += ((h ^ (h >> 31)) * _DIGEST_MUL) & _MASK64
        return len(lookup), total & _MASK64

    def slots(self) -> list[int]:
        return [s for s, lookup in self._lookups.items() if lookup]

    def holds(self, slot: int, block_hash: int) -> bool:
        return block_hash in self._lookups.get(slot, ())

    def store(self, slot: int, parent_hash: int | None, blocks: Sequence[BlockLike]) -> bool:
        """Add a chain of blocks under ``parent_hash`` (an id the slot holds; None: the root)."""
        return self.store_hashes(
            slot, parent_hash, list(map(_BLOCK_ID, blocks)), list(map(_TOKENS_HASH, blocks))
        )

    def store_hashes(
        self, slot: int, parent_hash: int | None, block_hashes: list[int], local_hashes: list[int]
    ) -> bool:
        """:meth:`store` with parallel lists of external ids and local hashes (the tree may keep
        the lists: the caller must not modify them afterwards).

        Re-storing a block with its current id is a no-op; an id the slot uses elsewhere is first
        removed there (with its descendants). Returns False when the parent is unknown (nothing is
        stored) or was lost to such a removal (the blocks before it stay stored).
        """
        lookup = self._lookups.get(slot)
        if lookup is None:
            lookup = self._lookups[slot] = {}
        node, off = self._root, -1
        if parent_hash is not None:
            found = lookup.get(parent_hash)
            if found is None:
                return False
            node, off = found, index_of(found.held[slot], parent_hash)
        if lookup.keys().isdisjoint(block_hashes) and len(set(block_hashes)) == len(block_hashes):
            self._extend(slot, lookup, node, off, block_hashes, local_hashes)  # all ids new
            return True
        cur_id = parent_hash
        for b, h in zip(block_hashes, local_hashes, strict=True):
            at = lookup.get(b)
            if at is not None:
                nxt = node.next_position(off, h)
                if nxt is not None and nxt[0] is at and at.held[slot][nxt[1]] == b:
                    node, off = nxt
                    cur_id = b
                    continue
                self._remove_one(slot, lookup, b, None)
                if cur_id is not None:  # re-find our position: the removal may have reshaped it
                    found = lookup.get(cur_id)
                    if found is None:
                        return False
                    node, off = found, index_of(found.held[slot], cur_id)
            node, off = self._extend(slot, lookup, node, off, [b], [h])
            cur_id = b
        return True

    def remove(
        self, slot: int, block_hashes: Sequence[int], removed: list[int] | None = None
    ) -> int:
        """Drop blocks by external id; the slot also loses every descendant of a dropped block.

        Returns how many ids were unknown. ``removed`` (optional) collects every id the slot lost.
        """
        lookup = self._lookups.get(slot)
        if lookup is None:
            return len(block_hashes)
        unknown, i, n = 0, 0, len(block_hashes)
        while i < n:
            b = block_hashes[i]
            node = lookup.get(b)
            i += 1
            if node is None:
                unknown += 1
                continue
            # An engine evicts a released chain tail first: the ids that follow are often the
            # blocks just before this one in its run. Removing the earliest of them removes the
            # rest with it (descendants go too), so the run is cut once, not once per block.
            ids = node.held[slot]
            t = index_of(ids, b)
            while i < n and t > 0 and block_hashes[i] == ids[t - 1]:
                t -= 1
                i += 1
            self._remove_at(slot, lookup, node, t, removed)
        return unknown

    def apply_raw(self, slot: int, raw: bytes) -> tuple[int, int, int]:
        """Apply a raw event buffer to the slot, in order; ``(ok, parent_not_found,
        block_not_found)`` counts of its events (see ``_radix.pyi``)."""
        if not isinstance(raw, bytes):
            raise TypeError("raw events are bytes")
        ok = parent = block = 0
        for event in decode(raw):
            data = event.data
            if type(data) is BlocksStored:
                if self.store(slot, data.parent_hash, data.blocks):
                    ok += 1
                else:
                    parent += 1
            elif type(data) is BlocksRemoved and self.remove(slot, data.block_hashes):
                block += 1
            else:
                ok += 1
        return ok, parent, block

    def clear(self, slot: int) -> None:
        """Drop every block of the slot."""
        lookup = self._lookups.get(slot)
        if lookup:
            root = self._root
            for top in {n for n in lookup.values() if n.parent is root}:
                self._detach(slot, lookup, top, None)
        self._lookups.pop(slot, None)

    def find_matches(self, local_hashes: Sequence[int]) -> dict[int, int]:
        """slot -> number of leading blocks of ``local_hashes`` the slot holds (absent: 0)."""
        q = local_hashes if type(local_hashes) is list else list(local_hashes)
        n = len(q)
        scores: dict[int, int] = {}
        node = self._root
        prev: dict[int, list[int]] | None = None
        i = 0
        while i < n:
            kids = node.kids
            if kids is None:
                break
            child = kids.get(q[i])
            if child is None:
                break
            hs = child.hashes
            run = len(hs)
            matched = run if hs == q[i : i + run] else common_prefix(hs, 0, q, i)
            held = child.held
            # holders only shrink along a path: equal sizes mean equal sets
            if prev is not None and len(held) != len(prev):
                for s in prev.keys() - held.keys():
                    scores[s] = i
            prev = held
            i += matched
            if matched < run:
                break
            node = child
        if prev:
            for s in prev:
                scores[s] = i
        return scores

    def dump(self, slot: int) -> list[BlocksStored]:
        """The slot's blocks as stored events, parents first, one per run; storing them in order
        into an empty slot rebuilds exactly this slot's state."""
        out: list[BlocksStored] = []
        stack = [self._root]
        while stack:
            n = stack.pop()
            if n.parent is not None:
                ids = n.held[slot]
                p = n.parent
                parent_hash = p.held[slot][-1] if p.parent is not None else None
                blocks = [StoredBlock(b, h) for b, h in zip(ids, n.hashes, strict=True)]
                out.append(BlocksStored(parent_hash=parent_hash, blocks=blocks))
            if n.kids:
                stack.extend(c for c in n.kids.values() if slot in c.held)
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant is broken (tests call it after each step)."""
        ids: dict[int, int] = {}
        blocks = 0
        for n in self._walk():
            n.check(self._lookups)
            if n.parent is not None:
                blocks += len(n.hashes)
                for s, lst in n.held.items():
                    ids[s] = ids.get(s, 0) + len(lst)
        if blocks != self._blocks:
            raise AssertionError(f"block count {self._blocks} != {blocks}")
        for s, lookup in self._lookups.items():
            if len(lookup) != ids.get(s, 0):
                raise AssertionError(f"slot {s} lookup holds ids found on no run")

    # --- internals -----------------------------------------------------------------------------

    def _walk(self) -> list[Run]:
        out, stack = [], [self._root]
        while stack:
            n = stack.pop()
            out.append(n)
            if n.kids:
                stack.extend(n.kids.values())
        return out

    def _extend(
        self,
        slot: int,
        lookup: dict[int, Run],
        node: Run,
        off: int,
        bl: list[int],
        hl: list[int],
    ) -> tuple[Run, int]:
        """Store new ids ``bl`` (none in ``lookup``) after position (node, off), which the slot
        holds (or the root). Returns the position of the last block."""
        i, m = 0, len(bl)
        while i < m:
            hs = node.hashes
            if off + 1 < len(hs):  # inside a run the slot holds
                run = common_prefix(hs, off + 1, hl, i)
                if run == 0:
                    node.split(off + 1, self._lookups)  # diverges here
                    continue
                node.replace_ids(slot, lookup, off + 1, bl[i : i + run])
                off += run
                i += run
                continue
            kids = node.kids
            c = kids.get(hl[i]) if kids is not None else None
            if c is None:
                rest_b, rest_h = (bl, hl) if i == 0 else (bl[i:], hl[i:])
                self._blocks += len(rest_h)
                if kids is None and node.parent is not None and len(node.held) == 1:
                    hs.extend(rest_h)  # the slot's own leaf run grows in place
                    node.held[slot].extend(rest_b)
                    lookup.update(zip(rest_b, repeat(node)))
                    return node, len(hs) - 1
                child = Run(node, rest_h, {slot: rest_b})
                node.add_child(child)
                lookup.update(zip(rest_b, repeat(child)))
                return child, len(rest_h) - 1
            run = common_prefix(c.hashes, 0, hl, i)
            if slot in c.held:
                c.replace_ids(slot, lookup, 0, bl[i : i + run])
            else:
                if run < len(c.hashes):
                    c.split(run, self._lookups)
                ids = c.held[slot] = bl[i : i + run]
                lookup.update(zip(ids, repeat(c)))
            node, off = c, run - 1
            i += run
        return node, off

    def _remove_one(
        self, slot: int, lookup: dict[int, Run], b: int, removed: list[int] | None
    ) -> bool:
        node = lookup.get(b)
        if node is None:
            return False
        self._remove_at(slot, lookup, node, index_of(node.held[slot], b), removed)
        return True

    def _remove_at(
        self, slot: int, lookup: dict[int, Run], node: Run, t: int, removed: list[int] | None
    ) -> None:
        """The slot lets go of block ``t`` of run ``node`` and everything after it."""
        if t > 0:
            if len(node.held) > 1:
                node = node.split(t, self._lookups)
            else:  # the slot's own run: cut it short
                lst = node.held[slot]
                dropped = lst[t:]
                del lst[t:], node.hashes[t:]
                for x in dropped:
                    del lookup[x]
                if removed is not None:
                    removed.extend(dropped)
                self._blocks -= len(dropped)
                kids, node.kids = node.kids, None  # unlink first: no merge may pull one back
                for c in (kids or {}).values():
                    self._detach(slot, lookup, c, removed)
                return
        self._detach(slot, lookup, node, removed)

    def _detach(
        self, slot: int, lookup: dict[int, Run], top: Run, removed: list[int] | None
    ) -> None:
        """The slot lets go of run ``top`` and all of its descendants."""
        survivors: list[Run | None] = [top.parent]
        stack = [top]
        while stack:
            n = stack.pop()
            lst = n.held.pop(slot)
            for x in lst:
                del lookup[x]
            if removed is not None:
                removed.extend(lst)
            kids = n.kids
            if kids:
                stack.extend(c for c in kids.values() if slot in c.held)
            if not n.held:  # nobody left
                self._blocks -= len(n.hashes)
                n.unlink()
            else:
                survivors.append(n)
        for m in survivors:  # holders changed: runs may join their only child again
            if m is not None:
                m.join_only_child(self._lookups)

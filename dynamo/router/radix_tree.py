"""The prefix tree of KV blocks held by workers (FACTS §3.1): the mechanism under the router's
indexer, the worker-local index and the approximate index. Pure data: no event ids, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Protocol

from dynamo.protocol.kv_events import BlocksStored, StoredBlock

WorkerKey = tuple[int, int]
"""A routing target: (worker_id, dp_rank)."""


class BlockLike(Protocol):
    @property
    def block_hash(self) -> int: ...
    @property
    def tokens_hash(self) -> int: ...


class _Node:
    """A run of consecutive blocks held by the same slots.

    ``held[slot][i]`` is the slot's external id of block i of the run.
    """

    __slots__ = ("parent", "hashes", "kids", "held")

    def __init__(self, parent: _Node | None, hashes: list[int], held: dict[int, list[int]]) -> None:
        self.parent = parent
        self.hashes = hashes  # local block hashes of the run (the root's is empty)
        self.kids: dict[int, _Node] | None = None  # by the first hash of each child run
        self.held = held


class RadixTree:
    """A path-compressed prefix tree of local block hashes; each run records which *slots* hold it.

    A slot is a small int the owner allocates per holder (the indexer: one per (worker, dp_rank)).
    Each slot names its blocks by external ids (one per block; storing a new id for a block the
    slot holds replaces the old id). Invariants (see :meth:`check_invariants`):

    * a slot holds whole runs; a run no slot holds is unlinked at once (memory follows held blocks);
    * a slot holding a run holds its parent run (prefix-closed), so holder sets only shrink along a
      path; :meth:`find_matches` relies on it: a slot's score is where it drops out;
    * each slot's lookup maps each of its external ids to the run holding it.

    Work is per run, not per block (list slices and bulk dict updates), which is what makes a pure
    Python index fast enough. Single-threaded: one owner mutates it; nothing here awaits.
    """

    __slots__ = ("_root", "_lookups", "_blocks")

    def __init__(self) -> None:
        self._root = _Node(None, [], {})
        self._lookups: dict[int, dict[int, _Node]] = {}
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

    def slots(self) -> list[int]:
        return [s for s, lookup in self._lookups.items() if lookup]

    def holds(self, slot: int, block_hash: int) -> bool:
        return block_hash in self._lookups.get(slot, ())

    def store(self, slot: int, parent_hash: int | None, blocks: Sequence[BlockLike]) -> bool:
        """Add a chain of blocks under ``parent_hash`` (an id the slot holds; None: the root)."""
        return self.store_hashes(
            slot, parent_hash, [b.block_hash for b in blocks], [b.tokens_hash for b in blocks]
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
            node, off = found, _index(found.held[slot], parent_hash)
        if lookup.keys().isdisjoint(block_hashes) and len(set(block_hashes)) == len(block_hashes):
            self._extend(slot, lookup, node, off, block_hashes, local_hashes)  # all ids new
            return True
        cur_id = parent_hash
        for b, h in zip(block_hashes, local_hashes, strict=True):
            at = lookup.get(b)
            if at is not None:
                nxt = self._next(node, off, h)
                if nxt is not None and nxt[0] is at and at.held[slot][nxt[1]] == b:
                    node, off = nxt
                    cur_id = b
                    continue
                self._remove_one(slot, lookup, b, None)
                if cur_id is not None:  # re-find our position: the removal may have reshaped it
                    found = lookup.get(cur_id)
                    if found is None:
                        return False
                    node, off = found, _index(found.held[slot], cur_id)
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
        return sum(1 for b in block_hashes if not self._remove_one(slot, lookup, b, removed))

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
            matched = run if hs == q[i : i + run] else _common(hs, 0, q, i)
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
            for h, c in (n.kids or {}).items():
                if c.parent is not n or not c.hashes or c.hashes[0] != h:
                    raise AssertionError("child run mislinked")
                if not c.held or (n.parent is not None and not c.held.keys() <= n.held.keys()):
                    raise AssertionError("child run held by nobody or by a slot missing above")
            if n.kids == {}:
                raise AssertionError("empty child map kept")
            if n.parent is None:
                continue
            blocks += len(n.hashes)
            for s, lst in n.held.items():
                if len(lst) != len(n.hashes):
                    raise AssertionError(f"slot {s} id list does not cover its run")
                lookup = self._lookups.get(s, {})
                if any(lookup.get(b) is not n for b in lst):
                    raise AssertionError(f"slot {s} lookup disagrees with a run")
                ids[s] = ids.get(s, 0) + len(lst)
        if blocks != self._blocks:
            raise AssertionError(f"block count {self._blocks} != {blocks}")
        for s, lookup in self._lookups.items():
            if len(lookup) != ids.get(s, 0):
                raise AssertionError(f"slot {s} lookup holds ids found on no run")

    # --- internals -----------------------------------------------------------------------------

    def _walk(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            n = stack.pop()
            out.append(n)
            if n.kids:
                stack.extend(n.kids.values())
        return out

    def _next(self, node: _Node, off: int, h: int) -> tuple[_Node, int] | None:
        if off + 1 < len(node.hashes):
            return (node, off + 1) if node.hashes[off + 1] == h else None
        c = node.kids.get(h) if node.kids else None
        return None if c is None else (c, 0)

    def _extend(
        self,
        slot: int,
        lookup: dict[int, _Node],
        node: _Node,
        off: int,
        bl: list[int],
        hl: list[int],
    ) -> tuple[_Node, int]:
        """Store new ids ``bl`` (none in ``lookup``) after position (node, off), which the slot
        holds (or the root). Returns the position of the last block."""
        i, m = 0, len(bl)
        while i < m:
            hs = node.hashes
            if off + 1 < len(hs):  # inside a run the slot holds
                run = _common(hs, off + 1, hl, i)
                if run == 0:
                    self._split(node, off + 1)  # diverges here
                    continue
                self._replace_ids(slot, lookup, node, off + 1, bl[i : i + run])
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
                child = _Node(node, rest_h, {slot: rest_b})
                if kids is None:
                    node.kids = {rest_h[0]: child}
                else:
                    kids[rest_h[0]] = child
                lookup.update(zip(rest_b, repeat(child)))
                return child, len(rest_h) - 1
            run = _common(c.hashes, 0, hl, i)
            if slot in c.held:
                self._replace_ids(slot, lookup, c, 0, bl[i : i + run])
            else:
                if run < len(c.hashes):
                    self._split(c, run)
                ids = c.held[slot] = bl[i : i + run]
                lookup.update(zip(ids, repeat(c)))
            node, off = c, run - 1
            i += run
        return node, off

    def _replace_ids(
        self, slot: int, lookup: dict[int, _Node], node: _Node, start: int, new: list[int]
    ) -> None:
        lst = node.held[slot]
        end = start + len(new)
        for x in lst[start:end]:
            del lookup[x]
        lst[start:end] = new
        lookup.update(zip(new, repeat(node)))

    def _split(self, node: _Node, t: int) -> _Node:
        """Cut ``node`` before block t (0 < t < len); the tail becomes its only child."""
        tail = _Node(node, node.hashes[t:], {})
        for s, lst in node.held.items():
            tail.held[s] = tl = lst[t:]
            del lst[t:]
            self._lookups[s].update(zip(tl, repeat(tail)))
        tail.kids = node.kids
        for c in (tail.kids or {}).values():
            c.parent = tail
        del node.hashes[t:]
        node.kids = {tail.hashes[0]: tail}
        return tail

    def _remove_one(
        self, slot: int, lookup: dict[int, _Node], b: int, removed: list[int] | None
    ) -> bool:
        node = lookup.get(b)
        if node is None:
            return False
        t = _index(node.held[slot], b)
        if t > 0:
            if len(node.held) > 1:
                node = self._split(node, t)
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
                return True
        self._detach(slot, lookup, node, removed)
        return True

    def _detach(
        self, slot: int, lookup: dict[int, _Node], top: _Node, removed: list[int] | None
    ) -> None:
        """The slot lets go of run ``top`` and all of its descendants."""
        survivors: list[_Node | None] = [top.parent]
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
            if not n.held:  # nobody left: unlink (breaking the parent <-> child cycle)
                self._blocks -= len(n.hashes)
                p = n.parent
                if p is not None and p.kids is not None and p.kids.get(n.hashes[0]) is n:
                    del p.kids[n.hashes[0]]
                    if not p.kids:
                        p.kids = None
                n.parent = None
                n.kids = None
            else:
                survivors.append(n)
        for m in survivors:  # holders changed: runs may join their only child again
            if m is not None:
                self._maybe_merge(m)

    def _maybe_merge(self, n: _Node) -> None:
        """Join a run with its only child when both have the same holders (keeps runs long)."""
        if n.parent is None or not n.held:
            return  # the root, or a run already merged away
        while n.kids is not None and len(n.kids) == 1:
            (c,) = n.kids.values()
            if c.held.keys() != n.held.keys():
                return
            n.hashes.extend(c.hashes)
            for s, lst in c.held.items():
                n.held[s].extend(lst)
                self._lookups[s].update(zip(lst, repeat(n)))
            n.kids = c.kids
            for g in (n.kids or {}).values():
                g.parent = n
            c.parent = None
            c.kids = None


def _index(lst: list[int], x: int) -> int:
    return len(lst) - 1 if lst[-1] == x else lst.index(x)


def _common(a: list[int], ai: int, b: list[int], bi: int) -> int:
    """Length of the common prefix of a[ai:] and b[bi:]."""
    n = min(len(a) - ai, len(b) - bi)
    if a[ai : ai + n] == b[bi : bi + n]:
        return n
    k = 0
    while a[ai + k] == b[bi + k]:
        k += 1
    return k


class SlotMap:
    """Allocates small-int slots for worker keys and maps them back (freed slots are reused)."""

    __slots__ = ("_slot_of", "_key_of", "_free")

    def __init__(self) -> None:
        self._slot_of: dict[WorkerKey, int] = {}
        self._key_of: list[WorkerKey] = []
        self._free: list[int] = []

    def get(self, key: WorkerKey) -> int | None:
        return self._slot_of.get(key)

    def slot(self, key: WorkerKey) -> int:
        s = self._slot_of.get(key)
        if s is None:
            if self._free:
                s = self._free.pop()
                self._key_of[s] = key
            else:
                s = len(self._key_of)
                self._key_of.append(key)
            self._slot_of[key] = s
        return s

    def release(self, key: WorkerKey) -> int | None:
        s = self._slot_of.pop(key, None)
        if s is not None:
            self._free.append(s)
        return s

    def keys(self) -> list[WorkerKey]:
        return list(self._slot_of)

    def to_keys(self, scores: dict[int, int]) -> dict[WorkerKey, int]:
        key_of = self._key_of
        return {key_of[s]: d for s, d in scores.items()}

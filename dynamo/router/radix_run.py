"""A run of the path-compressed KV prefix tree (router/radix_tree.py): consecutive blocks held by
the same slots, and the run operations (split, join, unlink) that keep the slots' lookups right.
"""

from __future__ import annotations

from itertools import repeat

Lookups = dict[int, dict[int, "Run"]]
"""slot -> (external block id -> the run holding it)."""


class Run:
    """Blocks ``hashes`` (local hashes) below ``parent``; ``held[slot][i]`` is the slot's
    external id of block i. The root run has no parent and no blocks."""

    __slots__ = ("parent", "hashes", "kids", "held")

    def __init__(self, parent: Run | None, hashes: list[int], held: dict[int, list[int]]) -> None:
        self.parent = parent
        self.hashes = hashes
        self.kids: dict[int, Run] | None = None  # by the first hash of each child run
        self.held = held

    def next_position(self, off: int, h: int) -> tuple[Run, int] | None:
        """The position after block ``off`` if its local hash is ``h``."""
        if off + 1 < len(self.hashes):
            return (self, off + 1) if self.hashes[off + 1] == h else None
        c = self.kids.get(h) if self.kids else None
        return None if c is None else (c, 0)

    def add_child(self, child: Run) -> None:
        if self.kids is None:
            self.kids = {child.hashes[0]: child}
        else:
            self.kids[child.hashes[0]] = child

    def split(self, t: int, lookups: Lookups) -> Run:
        """Cut before block t (0 < t < len); the tail becomes this run's only child."""
        tail = Run(self, self.hashes[t:], {})
        for s, lst in self.held.items():
            tail.held[s] = tl = lst[t:]
            del lst[t:]
            lookups[s].update(zip(tl, repeat(tail)))
        tail.kids = self.kids
        for c in (tail.kids or {}).values():
            c.parent = tail
        del self.hashes[t:]
        self.kids = {tail.hashes[0]: tail}
        return tail

    def replace_ids(self, slot: int, lookup: dict[int, Run], start: int, new: list[int]) -> None:
        """The slot names blocks start.. by ``new`` ids (none in use); the old ids are dropped."""
        lst = self.held[slot]
        end = start + len(new)
        for x in lst[start:end]:
            del lookup[x]
        lst[start:end] = new
        lookup.update(zip(new, repeat(self)))

    def join_only_child(self, lookups: Lookups) -> None:
        """Absorb the only child while it has the same holders (keeps runs long after removals)."""
        if self.parent is None or not self.held:
            return  # the root, or a run already joined into its parent
        while self.kids is not None and len(self.kids) == 1:
            (c,) = self.kids.values()
            if c.held.keys() != self.held.keys():
                return
            self.hashes.extend(c.hashes)
            for s, lst in c.held.items():
                self.held[s].extend(lst)
                lookups[s].update(zip(lst, repeat(self)))
            self.kids = c.kids
            for g in (self.kids or {}).values():
                g.parent = self
            c.parent = None
            c.kids = None

    def unlink(self) -> None:
        """Leave the tree: off the parent's child map, no references kept (no reference cycle)."""
        p = self.parent
        if p is not None and p.kids is not None and p.kids.get(self.hashes[0]) is self:
            del p.kids[self.hashes[0]]
            if not p.kids:
                p.kids = None
        self.parent = None
        self.kids = None

    def check(self, lookups: Lookups) -> None:
        """Raise AssertionError if this run or its links to its children are inconsistent."""
        if self.kids == {}:
            raise AssertionError("empty child map kept")
        for h, c in (self.kids or {}).items():
            if c.parent is not self or not c.hashes or c.hashes[0] != h:
                raise AssertionError("child run mislinked")
            if not c.held or (self.parent is not None and not c.held.keys() <= self.held.keys()):
                raise AssertionError("child run held by nobody or by a slot missing above")
        for s, lst in self.held.items():
            if len(lst) != len(self.hashes):
                raise AssertionError(f"slot {s} id list does not cover its run")
            lookup = lookups.get(s, {})
            if any(lookup.get(b) is not self for b in lst):
                raise AssertionError(f"slot {s} lookup disagrees with a run")


def index_of(ids: list[int], x: int) -> int:
    """Position of id x in a run's id list (most often the last: a chain's parent)."""
    return len(ids) - 1 if ids[-1] == x else ids.index(x)


def common_prefix(a: list[int], ai: int, b: list[int], bi: int) -> int:
    """Length of the common prefix of a[ai:] and b[bi:]."""
    n = min(len(a) - ai, len(b) - bi)
    if a[ai : ai + n] == b[bi : bi + n]:
        return n
    k = 0
    while a[ai + k] == b[bi + k]:
        k += 1
    return k

"""router/_apply_raw.c against its fallback (``_apply_raw_fallback.py``) on randomized buffers
and rank states: the same answer, the same rank ids, counters and tree blocks, the same errors."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

from dynamo.protocol import kv_raw
from dynamo.protocol.kv_events import BlocksRemoved, BlocksStored, KVCacheEvent, StoredBlock
from dynamo.router import _apply_raw_fallback as py
from dynamo.router.indexer import EventStatus
from dynamo.router.radix_tree import RadixTree

KEYS = (EventStatus.OK, EventStatus.PARENT_BLOCK_NOT_FOUND, EventStatus.BLOCK_NOT_FOUND)


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.router._apply_raw")


@dataclass(slots=True)
class SlottedRank:  # read at its slot offsets (as indexer._Rank)
    slot: int
    last_id: Any = None
    recovering: Any = False


class PlainRank:  # no slots: read through getattr
    def __init__(self, slot: int, last_id: Any = None, recovering: Any = False) -> None:
        self.slot, self.last_id, self.recovering = slot, last_id, recovering


def events(rng: random.Random, first: int, dp_rank: int) -> list[KVCacheEvent]:
    out = []
    for i in range(rng.randrange(1, 4)):
        ids = [rng.randrange(30) for _ in range(rng.randrange(1, 4))]
        if rng.random() < 0.6:
            parent = None if rng.random() < 0.3 else rng.randrange(30)
            data: Any = BlocksStored(
                parent_hash=parent, blocks=[StoredBlock(b, rng.randrange(3)) for b in ids]
            )
        else:
            data = BlocksRemoved(block_hashes=ids)
        out.append(KVCacheEvent(event_id=first + i, data=data, dp_rank=dp_rank))
    return out


def state(ranks: dict[tuple[int, int], Any], tree: RadixTree) -> list[object]:
    return [(k, r.last_id, r.recovering, tree.digest(r.slot)) for k, r in sorted(ranks.items())]


@pytest.mark.parametrize("rank_type", [SlottedRank, PlainRank])
def test_native_and_fallback_agree_on_random_buffers(native: ModuleType, rank_type: type) -> None:
    lasts = [None, 0, 3]
    sides = []
    for module in (native, py):
        ranks = {(7, r): rank_type(r, lasts[r]) for r in range(3)}
        tree, counters = RadixTree(), dict.fromkeys(EventStatus, 0)
        sides.append((module.InOrderApplier(ranks, tree, counters, *KEYS).apply, ranks, tree))
    rng = random.Random(5)
    for step in range(400):
        worker = rng.choice([7, 7, 7, 8])  # worker 8 is unknown
        dp_rank = rng.randrange(4)  # rank 3 is unknown
        ref = sides[1][1].get((worker, dp_rank))
        r = rng.random()
        if ref is None or type(ref.last_id) is not int or not 0 <= ref.last_id < 2**60 or r < 0.1:
            first = rng.randrange(6)
        else:
            first = max(0, ref.last_id + 1 + (rng.choice([-2, -1, 1, 2]) if r < 0.3 else 0))
        raw = kv_raw.encode(events(rng, first, dp_rank))
        flip = rng.random() < 0.05  # a rank enters or leaves recovery, or its id is reset
        last = rng.choice([None, 0, -1, True, 2**64 - 1, 2**70])
        got = []
        for apply, ranks, tree in sides:
            if flip and (worker, dp_rank) in ranks:
                st = ranks[(worker, dp_rank)]
                st.recovering = not st.recovering
                st.last_id = last
            got.append((apply(worker, raw), state(ranks, tree)))
        assert got[0] == got[1], step
        if not got[0][0] and (worker, dp_rank) in ranks and rng.random() < 0.7:
            _, first, n = kv_raw.header(raw)  # as the caller's decoded path would leave it
            for _, ranks, _ in sides:
                ranks[(worker, dp_rank)].last_id, ranks[(worker, dp_rank)].recovering = (
                    first + n - 1,
                    False,
                )
    assert sides[0][2].digest(0) == sides[1][2].digest(0)


@pytest.mark.parametrize("which", ["native", "fallback"])
def test_edges(native: ModuleType, which: str) -> None:
    module = native if which == "native" else py
    tree, counters = RadixTree(), dict.fromkeys(EventStatus, 0)
    ranks = {(1, 0): SlottedRank(0, 4)}
    apply = module.InOrderApplier(ranks, tree, counters, *KEYS).apply
    data = BlocksStored(parent_hash=None, blocks=[StoredBlock(9, 1)])
    one = kv_raw.encode([KVCacheEvent(event_id=5, data=data, dp_rank=0)])
    assert apply(1, b"") is True
    assert apply(1, one[:16]) is False  # no header: the caller's decode raises
    with pytest.raises(TypeError):
        apply(1, bytearray(one))
    with pytest.raises(ValueError):  # malformed: the tree raises before anything changes
        apply(1, one + b"\0" * 8)
    assert ranks[(1, 0)].last_id == 4 and counters[EventStatus.OK] == 0
    assert apply(1, one) is True
    assert ranks[(1, 0)].last_id == 5 and counters[EventStatus.OK] == 1
    assert tree.find_matches([1]) == {0: 1}
    assert apply(1, one) is False  # stale: decoded by the caller
    del counters[EventStatus.OK]  # a counter it cannot add to
    ranks[(1, 0)].last_id = 4
    with pytest.raises(KeyError):
        apply(1, one)
    with pytest.raises(TypeError):
        module.InOrderApplier([], tree, {}, *KEYS)


@pytest.mark.parametrize("which", ["native", "fallback"])
def test_the_rank_applied_is_the_dicts_current_one(native: ModuleType, which: str) -> None:
    """A rank replaced, removed or added between buffers (the native side remembers the states it
    looked up while the dict is unchanged): each buffer goes to the state the dict holds then."""
    module = native if which == "native" else py
    tree, counters = RadixTree(), dict.fromkeys(EventStatus, 0)
    big = 2**63 + 5  # a worker id past the signed range
    old = SlottedRank(0, 4)
    ranks: dict[tuple[int, int], Any] = {(1, 0): old, (big, 2): SlottedRank(2, 0)}
    apply = module.InOrderApplier(ranks, tree, counters, *KEYS).apply

    def stored(event_id: int, block: int, dp_rank: int = 0) -> bytes:
        data = BlocksStored(parent_hash=None, blocks=[StoredBlock(block, block)])
        return kv_raw.encode([KVCacheEvent(event_id=event_id, data=data, dp_rank=dp_rank)])

    assert apply(1, stored(5, 9)) is True and old.last_id == 5
    assert apply(big, stored(1, 8, 2)) is True and ranks[(big, 2)].last_id == 1
    new = SlottedRank(1, 4)
    ranks[(1, 0)] = new  # the same key, another state
    assert apply(1, stored(5, 9)) is True
    assert (old.last_id, new.last_id) == (5, 5)
    assert tree.find_matches([9]) == {0: 1, 1: 1}
    del ranks[(1, 0)]
    assert apply(1, stored(6, 7)) is False  # unknown now: the caller decodes it
    ranks[(1, 0)] = old
    assert apply(1, stored(6, 7)) is True and old.last_id == 6
    assert apply(True, stored(7, 6)) is True and old.last_id == 7  # True == 1: the same key
    assert apply(big, stored(2, 5, 2)) is True and ranks[(big, 2)].last_id == 2
    assert counters[EventStatus.OK] == 6

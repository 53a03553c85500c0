"""router/_radix.c (one node per block) against its fallback (``_radix_fallback.py``, path
compressed): random operation sequences give the same results (store and remove outcomes, the
ids lost, matches, per-slot counts and digests, dumps that rebuild the same state), a pass's
raw events (``apply_raw``) apply as ``store`` / ``remove`` of each event, and bad input is
refused with an exception, never a crash."""

from __future__ import annotations

import random
import struct
from types import ModuleType
from typing import Any

import pytest

from dynamo.protocol import kv_raw
from dynamo.protocol.kv_events import BlocksRemoved, BlocksStored, KVCacheEvent, StoredBlock
from dynamo.router import _radix_fallback as py

SLOTS = 5


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.router._radix")


def an_id(rng: random.Random) -> int:
    """Mostly small ids (so they collide and get re-stored), some negative or full 64-bit."""
    r = rng.random()
    if r < 0.9:
        return rng.randrange(60)
    if r < 0.95:
        return -rng.randrange(1, 1 << 63)
    return rng.randrange(1 << 63, 1 << 64)


def chain(rng: random.Random, length: int) -> tuple[list[int], list[int]]:
    # few local hashes: chains share prefixes, diverge and re-join
    return [an_id(rng) for _ in range(length)], [rng.randrange(6) for _ in range(length)]


def same_state(a: Any, b: Any, rng: random.Random, queries: list[list[int]]) -> None:
    a.check_invariants()
    b.check_invariants()
    assert a.num_blocks_total == b.num_blocks_total
    assert sorted(a.slots()) == sorted(b.slots())
    # the native count is the fully joined one; the fallback may keep a run split
    assert a.num_nodes <= b.num_nodes
    for s in range(SLOTS):
        assert a.num_blocks(s) == b.num_blocks(s)
        assert a.digest(s) == b.digest(s)
    for q in queries:
        assert a.find_matches(q) == b.find_matches(q)
    for _ in range(5):
        s, x = rng.randrange(SLOTS), an_id(rng)
        assert a.holds(s, x) == b.holds(s, x)


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_match_the_fallback(native: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    a, b = native.RadixTree(), py.RadixTree()
    stored: list[list[int]] = []  # local-hash paths stored so far: queries that match
    for step in range(300):
        op = rng.random()
        s = rng.randrange(SLOTS)
        if op < 0.55:
            ids, hashes = chain(rng, rng.randrange(0, 7))
            parent = None if rng.random() < 0.4 else an_id(rng)
            if rng.random() < 0.5:
                blocks = [StoredBlock(i, h) for i, h in zip(ids, hashes, strict=True)]
                got, want = a.store(s, parent, blocks), b.store(s, parent, blocks)
            else:
                got = a.store_hashes(s, parent, list(ids), list(hashes))
                want = b.store_hashes(s, parent, list(ids), list(hashes))
            assert got == want, step
            stored.append(hashes)
        elif op < 0.9:
            ids = [an_id(rng) for _ in range(rng.randrange(1, 5))]
            ra: list[int] = []
            rb: list[int] = []
            assert a.remove(s, ids, ra) == b.remove(s, ids, rb), step
            assert sorted(ra) == sorted(rb), step
        elif op < 0.95:
            a.clear(s)
            b.clear(s)
        else:  # a slot's dump rebuilds it: clear it and store the dump back
            events = a.dump(s)
            assert sum(len(e.blocks) for e in events) == a.num_blocks(s)
            a.clear(s)
            b.clear(s)
            for ev in events:
                assert a.store(s, ev.parent_hash, ev.blocks)
                assert b.store(s, ev.parent_hash, ev.blocks)
        queries = [rng.choice(stored) for _ in range(3)] if stored else []
        queries.append([rng.randrange(6) for _ in range(rng.randrange(8))])
        same_state(a, b, rng, queries)


def test_queries_sharing_hash_objects_match_the_fallback(native: ModuleType) -> None:
    """Queries that share their leading hash objects (a prefix group's: the native tree reads
    their keys from its last query that began with the same object), lists changed in place
    after a query, new objects of equal or other values, the tree changing between queries."""
    rng = random.Random(11)
    a, b = native.RadixTree(), py.RadixTree()
    groups = [[rng.getrandbits(64) for _ in range(12)] for _ in range(3)]
    for step in range(400):
        base = rng.choice(groups)
        s = rng.randrange(SLOTS)
        if rng.random() < 0.3:  # store a prefix of a group (with a tail of its own)
            n = rng.randrange(1, 12)
            hashes = base[:n] + [rng.getrandbits(64) for _ in range(rng.randrange(3))]
            ids = [rng.getrandbits(64) for _ in hashes]
            assert a.store_hashes(s, None, ids, hashes) == b.store_hashes(s, None, ids, hashes)
        elif rng.random() < 0.2:
            a.clear(s)
            b.clear(s)
        query = base[: rng.randrange(13)]
        if query and rng.random() < 0.4:  # a tail of new objects, equal values or not
            k = rng.randrange(len(query))
            query[k:] = [int(str(x)) if rng.random() < 0.5 else x ^ 1 for x in query[k:]]
        assert a.find_matches(query) == b.find_matches(query), step
        if query and rng.random() < 0.3:  # changed after the query, then asked again
            query[rng.randrange(len(query))] = rng.choice(base)
            assert a.find_matches(query) == b.find_matches(query), step
        if rng.random() < 0.1:  # a group's object replaced by another of the same value
            k = rng.randrange(12)
            base[k] = int(str(base[k]))
    a.check_invariants()


def test_a_shared_prefix_scores_each_slot_where_it_drops_out(native: ModuleType) -> None:
    t = native.RadixTree()
    assert t.store_hashes(0, None, [1, 2, 3, 4], [11, 12, 13, 14])
    assert t.store_hashes(1, None, [5, 6], [11, 12])
    assert t.store_hashes(1, 6, [7], [99])
    assert t.find_matches([11, 12, 13, 14]) == {0: 4, 1: 2}
    assert t.find_matches([11, 12, 99]) == {0: 2, 1: 3}
    assert t.find_matches([12]) == {}
    assert t.num_nodes == 3 and t.num_blocks_total == 5
    assert not t.store_hashes(0, 77, [8], [15])  # unknown parent: nothing stored
    removed: list[int] = []
    assert t.remove(0, [2, 42], removed) == 1  # 42 unknown; 2 takes 3 and 4 with it
    assert sorted(removed) == [2, 3, 4]
    assert t.find_matches([11, 12, 13]) == {0: 1, 1: 2}
    t.clear(1)
    assert t.slots() == [0] and t.num_blocks_total == 1
    t.check_invariants()


def test_ids_come_back_as_given(native: ModuleType) -> None:
    t = native.RadixTree()
    ids = [-5, (1 << 64) - 1, 0, -(1 << 63)]
    assert t.store_hashes(2, None, ids, [1, 2, 3, 4])
    (event,) = t.dump(2)
    assert event.parent_hash is None
    assert [blk.block_hash for blk in event.blocks] == ids
    assert t.digest(2) == py_digest(ids)
    removed: list[int] = []
    t.remove(2, [-5], removed)
    assert sorted(removed) == sorted(ids)


def py_digest(ids: list[int]) -> tuple[int, int]:
    t = py.RadixTree()
    t.store_hashes(0, None, list(ids), list(range(len(ids))))
    return t.digest(0)


def test_bad_input_is_refused(native: ModuleType) -> None:
    t = native.RadixTree()
    with pytest.raises(TypeError):
        t.store_hashes(0, None, ["x"], [1])
    with pytest.raises(ValueError, match="length"):
        t.store_hashes(0, None, [1, 2], [1])
    with pytest.raises(OverflowError):
        t.store_hashes(0, None, [1 << 64], [1])
    with pytest.raises(ValueError, match="slot"):
        t.store_hashes(-1, None, [1], [1])
    with pytest.raises(AttributeError):
        t.store(0, None, [object()])
    with pytest.raises(TypeError):
        t.remove(0, [1], removed=())
    with pytest.raises(TypeError):
        t.find_matches(None)
    assert t.find_matches([1 << 70]) == {}  # no block has such a hash
    assert not t.holds(0, 1 << 70)
    assert t.remove(3, [1, 2]) == 2  # a slot never seen
    t.clear(4)
    assert t.num_blocks_total == 0 and t.slots() == []
    t.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_raw_events_apply_as_store_and_remove(native: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    a, b, ref = native.RadixTree(), py.RadixTree(), native.RadixTree()
    stored: list[list[int]] = []
    event_id = rng.randrange(3)
    for step in range(60):
        s = rng.randrange(SLOTS)
        events: list[KVCacheEvent] = []
        want = [0, 0, 0]  # ok, parent not found, block not found
        for _ in range(rng.randrange(1, 5)):
            data: BlocksStored | BlocksRemoved
            if rng.random() < 0.6:
                ids, hashes = chain(rng, rng.randrange(1, 6))
                parent = None if rng.random() < 0.4 else an_id(rng)
                data = BlocksStored(
                    parent_hash=parent,
                    blocks=[StoredBlock(i, h) for i, h in zip(ids, hashes, strict=True)],
                )
                want[0 if ref.store(s, parent, data.blocks) else 1] += 1
                stored.append(hashes)
            else:
                ids = [an_id(rng) for _ in range(rng.randrange(0, 4))]
                data = BlocksRemoved(block_hashes=ids)
                want[2 if ref.remove(s, ids) else 0] += 1
            events.append(KVCacheEvent(event_id=event_id, data=data, dp_rank=seed))
            event_id += 1
        raw = kv_raw.encode(events)
        assert kv_raw.header(raw) == (seed, events[0].event_id, len(events))
        assert kv_raw.decode(raw) == events, step
        assert a.apply_raw(s, raw) == b.apply_raw(s, raw) == tuple(want), step
        queries = [rng.choice(stored) for _ in range(3)] if stored else []
        same_state(a, b, rng, queries)
        same_state(a, ref, rng, queries)
    assert a.apply_raw(0, b"") == b.apply_raw(0, b"") == (0, 0, 0)


@pytest.mark.parametrize("impl", ["native", "fallback"])
def test_malformed_raw_events_are_refused_whole(native: ModuleType, impl: str) -> None:
    t = native.RadixTree() if impl == "native" else py.RadixTree()
    stored = KVCacheEvent(
        event_id=4, data=BlocksStored(parent_hash=None, blocks=[StoredBlock(1, 11)])
    )
    good = kv_raw.encode([stored])
    words = struct.pack("=3Q", 0, 4, 2)  # two events announced, none follows
    bad_kind = struct.pack("=5Q", 0, 4, 1, 3 | 1 << 8, 7)
    for raw in (good[:-8], good[:-1], good + bytes(8), words, good[:16], bad_kind):
        with pytest.raises(ValueError):
            t.apply_raw(0, raw)
    with pytest.raises(TypeError):
        t.apply_raw(0, bytearray(good))  # type: ignore[arg-type]
    assert t.num_blocks_total == 0  # nothing applied
    assert t.apply_raw(0, good) == (1, 0, 0) and t.holds(0, 1)

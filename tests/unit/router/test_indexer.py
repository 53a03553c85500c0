"""KVIndexer: the prefix index against a brute-force model, event ids, gaps and recovery."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo.protocol import kv_raw
from dynamo.protocol.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    KVCacheEventData,
    KVEventBatch,
    KVRecoveryResponse,
    StoredBlock,
)
from dynamo.router.indexer import EventStatus, KVIndexer

Key = tuple[int, int]
Path = tuple[int, ...]


class Model:
    """Brute force: per (worker, rank) a map external id -> full path of local hashes."""

    def __init__(self) -> None:
        self.ext: dict[Key, dict[int, Path]] = {}

    def held(self, key: Key) -> set[Path]:
        return set(self.ext.get(key, {}).values())

    def store(self, key: Key, parent: int | None, blocks: list[tuple[int, int]]) -> bool:
        ext = self.ext.setdefault(key, {})
        if parent is None:
            cur: Path = ()
        elif parent in ext:
            cur = ext[parent]
        else:
            return False
        for b, h in blocks:
            target = (*cur, h)
            if b in ext:
                if ext[b] == target:
                    cur = target
                    continue
                self.remove(key, [b])
                if cur and cur not in self.held(key):
                    return False
            for e in [e for e, q in ext.items() if q == target]:
                del ext[e]  # one id per block: the new id replaces the old
            ext[b] = target
            cur = target
        return True

    def remove(self, key: Key, ids: list[int]) -> bool:
        ext = self.ext.setdefault(key, {})
        all_found = True
        for b in ids:
            if b not in ext:
                all_found = False
                continue
            p = ext.pop(b)
            for e, q in list(ext.items()):
                if q[: len(p)] == p:
                    del ext[e]
        return all_found

    def matches(self, query: list[int]) -> dict[Key, int]:
        out: dict[Key, int] = {}
        for key in self.ext:
            held = self.held(key)
            k = 0
            while k < len(query) and tuple(query[: k + 1]) in held:
                k += 1
            if k:
                out[key] = k
        return out

    def check_prefix_closed(self) -> None:
        for key in self.ext:
            held = self.held(key)
            for p in held:
                assert len(p) == 1 or p[:-1] in held


KEYS = [(1, 0), (1, 1), (2, 0), (3, 0)]
hashes = st.integers(0, 3)
KINDS = ["store", "store", "store", "remove", "restore", "clear", "remove_worker"]
PICK_FRESH, PICK_OLD = st.integers(0, 4), st.sampled_from([0, 1, 1, 1])
INDEX, UNKNOWN, SIZES = st.integers(0, 1000), st.integers(0, 3), st.integers(1, 4)


def _queries(model: Model, extra: list[list[int]]) -> list[list[int]]:
    qs = [list(p) + [9] for key in model.ext for p in model.held(key)]
    return qs + extra + [[]]


@settings(max_examples=400, deadline=None)
@given(st.data(), st.lists(st.lists(hashes, max_size=6), max_size=8), st.sampled_from([0, 1]))
def test_index_matches_brute_force(data: st.DataObject, extra: list[list[int]], first: int) -> None:
    """Random events drawn against the current state: parents and removals mostly name held
    blocks, new ids are mostly fresh, some reuse held ids (rebinds) or name unknown ones."""
    index, model = KVIndexer(), Model()
    next_id: dict[Key, itertools.count[int]] = {}
    fresh_ids = itertools.count(100)

    def send(key: Key, data: KVCacheEventData) -> EventStatus:
        eid = next(next_id.setdefault(key, itertools.count(first)))
        return index.apply(key[0], KVCacheEvent(event_id=eid, data=data, dp_rank=key[1]))

    def some_id(held: list[int], fresh: bool) -> int:
        pick = data.draw(PICK_FRESH if fresh else PICK_OLD)
        if pick >= 2:
            return next(fresh_ids)
        if pick == 1 and held:
            return held[data.draw(INDEX) % len(held)]
        return data.draw(UNKNOWN)  # mostly unknown ids (rarely a held one)

    for _ in range(data.draw(st.integers(0, 40))):
        kind, key = data.draw(st.sampled_from(KINDS)), data.draw(st.sampled_from(KEYS))
        held = sorted(model.ext.get(key, {}))
        if kind == "store":
            parent = None if data.draw(st.booleans()) else some_id(held, fresh=False)
            n = data.draw(SIZES)
            blocks = [(some_id(held, fresh=True), data.draw(hashes)) for _ in range(n)]
            ev = BlocksStored(parent_hash=parent, blocks=[StoredBlock(b, h) for b, h in blocks])
            ok = model.store(key, parent, blocks)
            expected = EventStatus.OK if ok else EventStatus.PARENT_BLOCK_NOT_FOUND
            assert send(key, ev) is expected
        elif kind == "remove":
            bids = [some_id(held, fresh=False) for _ in range(data.draw(st.integers(1, 2)))]
            ok = model.remove(key, bids)
            expected = EventStatus.OK if ok else EventStatus.BLOCK_NOT_FOUND
            assert send(key, BlocksRemoved(block_hashes=bids)) is expected
        elif kind == "restore":  # the engine re-announces a block the worker already holds
            if not held:
                continue
            b = data.draw(st.sampled_from(held))
            path = model.ext[key][b]
            parents = [e for e, q in model.ext[key].items() if q == path[:-1]]
            assert len(parents) == (1 if len(path) > 1 else 0)
            parent = parents[0] if parents else None
            assert model.store(key, parent, [(b, path[-1])])
            ev = BlocksStored(parent_hash=parent, blocks=[StoredBlock(b, path[-1])])
            assert send(key, ev) is EventStatus.OK
        elif kind == "clear":
            model.ext.pop(key, None)
            assert send(key, AllBlocksCleared()) is EventStatus.OK
        else:
            for k in [k for k in model.ext if k[0] == key[0]]:
                del model.ext[k]
            for k in [k for k in next_id if k[0] == key[0]]:
                del next_id[k]
            index.remove_worker(key[0])
        index.check_invariants()
        model.check_prefix_closed()
        for k in KEYS:
            assert index.num_blocks(*k) == len(model.ext.get(k, {}))
    for q in _queries(model, extra):
        assert index.find_matches(q) == model.matches(q)
    # memory follows held blocks: the tree keeps exactly the distinct held paths
    assert index.tree_blocks == len(set().union(*[model.held(k) for k in model.ext]))
    # a fresh index that ingests every dump ends with exactly the same state
    fresh, replay = KVIndexer(), Model()
    for key in KEYS:
        for ev in index.dump_events(*key):
            assert isinstance(ev.data, BlocksStored)
            assert fresh.apply_data(key[0], key[1], ev.data) is EventStatus.OK
            blocks = [(b.block_hash, b.tokens_hash) for b in ev.data.blocks]
            assert replay.store(key, ev.data.parent_hash, blocks)
        assert replay.ext.get(key, {}) == model.ext.get(key, {})
    fresh.check_invariants()
    for q in _queries(model, extra):
        assert fresh.find_matches(q) == model.matches(q)


def stored(
    eid: int, parent: int | None, blocks: list[tuple[int, int]], rank: int = 0
) -> KVCacheEvent:
    data = BlocksStored(parent_hash=parent, blocks=[StoredBlock(b, h) for b, h in blocks])
    return KVCacheEvent(event_id=eid, data=data, dp_rank=rank)


def test_find_matches_scores_per_worker_rank() -> None:
    index = KVIndexer()
    index.apply(7, stored(0, None, [(1, 11), (2, 12), (3, 13), (4, 14)]))
    index.apply(8, stored(1, None, [(5, 11), (6, 12)]))
    index.apply(9, stored(0, None, [(7, 11), (8, 12), (9, 13)], rank=1))
    assert index.find_matches([11, 12, 13, 14, 15]) == {(7, 0): 4, (8, 0): 2, (9, 1): 3}
    assert index.find_matches([12]) == {}
    assert index.find_matches([11, 99]) == {(7, 0): 1, (8, 0): 1, (9, 1): 1}


def test_removal_detaches_descendants_and_prunes_nodes() -> None:
    index = KVIndexer()
    index.apply(1, stored(0, None, [(1, 11), (2, 12), (3, 13)]))
    index.apply(2, stored(0, None, [(4, 11), (5, 12)]))
    assert index.tree_blocks == 3
    r = KVCacheEvent(event_id=1, data=BlocksRemoved(block_hashes=[2]))
    assert index.apply(1, r) is EventStatus.OK
    assert index.find_matches([11, 12, 13]) == {(1, 0): 1, (2, 0): 2}
    assert index.tree_blocks == 2  # block 13 had only worker 1
    index.remove_worker(2)
    assert index.tree_blocks == 1
    assert index.apply(1, stored(2, 3, [(9, 14)])) is EventStatus.PARENT_BLOCK_NOT_FOUND
    assert index.counters[EventStatus.PARENT_BLOCK_NOT_FOUND] == 1
    gone = KVCacheEvent(event_id=3, data=BlocksRemoved(block_hashes=[3]))
    assert index.apply(1, gone) is EventStatus.BLOCK_NOT_FOUND
    index.check_invariants()


def test_event_ids_start_at_zero_or_one_and_stale_ids_are_ignored() -> None:
    for first in (0, 1):
        index = KVIndexer()
        assert index.apply(1, stored(first, None, [(1, 11)])) is EventStatus.OK
        assert index.apply(1, stored(first, None, [(2, 22)])) is EventStatus.STALE
        assert index.apply(1, stored(first + 1, 1, [(3, 12)])) is EventStatus.OK
        assert index.last_event_id(1) == first + 1
        assert index.find_matches([11, 12]) == {(1, 0): 2}
    index = KVIndexer()
    assert index.apply(1, stored(5, None, [(1, 11)])) is EventStatus.GAP  # joined late
    assert index.recovery_request(1).start_event_id is None


def test_gap_then_tail_recovery_replays_buffer() -> None:
    index = KVIndexer()
    index.apply(1, stored(0, None, [(1, 11)]))
    index.apply(1, stored(1, 1, [(2, 12)]))
    # event 2 is lost; 3 arrives
    assert index.apply(1, stored(3, 2, [(4, 14)])) is EventStatus.GAP
    assert index.is_recovering(1)
    req = index.recovery_request(1)
    assert req.start_event_id == 2 and req.dp_rank == 0
    assert index.apply(1, stored(4, 4, [(5, 15)])) is EventStatus.BUFFERED
    assert index.find_matches([11, 12, 13]) == {(1, 0): 2}  # old state kept meanwhile
    resp = KVRecoveryResponse(
        worker_id=1,
        dp_rank=0,
        events=[stored(2, 2, [(3, 13)]), stored(3, 2, [(4, 14)])],
        is_dump=False,
        last_event_id=3,
    )
    assert index.apply_recovery(resp) is EventStatus.OK
    assert not index.is_recovering(1)
    assert index.last_event_id(1) == 4
    assert index.find_matches([11, 12, 13]) == {(1, 0): 3}
    assert index.find_matches([11, 12, 14, 15]) == {(1, 0): 4}
    assert index.counters[EventStatus.GAP] == 1
    assert index.counters[EventStatus.STALE] == 1  # the buffered copy of event 3
    index.check_invariants()


def test_gap_recovery_by_dump_replaces_state() -> None:
    index = KVIndexer()
    index.apply(1, stored(0, None, [(1, 11), (2, 12)]))
    gaps = index.apply_batch(KVEventBatch(worker_id=1, events=[stored(9, None, [(7, 77)])]))
    assert gaps == [(1, 0)]
    assert index.recovery_request(1, full=True).start_event_id is None
    index.apply(1, stored(10, 7, [(8, 78)]))  # buffered
    index.apply(1, stored(11, None, [(6, 66)]))  # buffered
    dump = KVRecoveryResponse(
        worker_id=1,
        dp_rank=0,
        events=[stored(0, None, [(1, 11)]), stored(0, None, [(7, 77)])],
        is_dump=True,
        last_event_id=10,
    )
    assert index.apply_recovery(dump) is EventStatus.OK
    assert index.last_event_id(1) == 11
    assert index.find_matches([11, 12]) == {(1, 0): 1}  # block 2 was removed meanwhile
    assert index.find_matches([77, 78]) == {(1, 0): 1}  # 10 <= last id of the dump: stale
    assert index.find_matches([66]) == {(1, 0): 1}
    index.check_invariants()


def test_tail_that_does_not_connect_escalates_to_dump() -> None:
    index = KVIndexer()
    index.apply(1, stored(0, None, [(1, 11)]))
    index.apply(1, stored(5, None, [(2, 12)]))
    assert index.recovery_request(1).start_event_id == 1
    bad_tail = KVRecoveryResponse(
        worker_id=1, dp_rank=0, events=[stored(4, None, [(3, 13)])], is_dump=False, last_event_id=5
    )
    assert index.apply_recovery(bad_tail) is EventStatus.GAP
    assert index.recovery_request(1).start_event_id is None
    index.cancel_recovery(1)
    assert not index.is_recovering(1)
    index.check_invariants()


def test_recovery_buffer_is_bounded() -> None:
    index = KVIndexer(recovery_buffer_limit=2)
    index.apply(1, stored(3, None, [(1, 11)]))  # gap: held (1 of 2)
    assert index.apply(1, stored(4, 1, [(2, 12)])) is EventStatus.BUFFERED
    assert index.apply(1, stored(5, 2, [(3, 13)])) is EventStatus.DROPPED
    assert index.counters[EventStatus.DROPPED] == 1


def test_ranks_are_independent_and_clear() -> None:
    index = KVIndexer()
    index.apply(1, stored(0, None, [(1, 11)], rank=0))
    index.apply(1, stored(0, None, [(1, 11)], rank=1))
    assert index.find_matches([11]) == {(1, 0): 1, (1, 1): 1}
    index.apply(1, KVCacheEvent(event_id=1, data=AllBlocksCleared(), dp_rank=1))
    assert index.find_matches([11]) == {(1, 0): 1}
    index.clear(1, 0)
    assert index.find_matches([11]) == {}
    assert index.tree_blocks == 0 and index.num_nodes == 0
    assert sorted(index.workers()) == [(1, 0), (1, 1)]
    index.remove_worker(1)
    assert index.workers() == []
    index.check_invariants()


def test_restoring_held_blocks_is_idempotent_and_new_ids_replace_old() -> None:
    index = KVIndexer()
    chain = [StoredBlock(1, 11), StoredBlock(2, 12)]
    index.apply_data(1, 0, BlocksStored(parent_hash=None, blocks=chain))
    index.apply_data(1, 0, BlocksStored(parent_hash=None, blocks=[StoredBlock(1, 11)]))
    assert index.find_matches([11, 12]) == {(1, 0): 2}
    # a second id for the same block replaces the first; the child stays
    index.apply_data(1, 0, BlocksStored(parent_hash=None, blocks=[StoredBlock(5, 11)]))
    assert index.apply_data(1, 0, BlocksRemoved(block_hashes=[1])) is EventStatus.BLOCK_NOT_FOUND
    assert index.find_matches([11, 12]) == {(1, 0): 2}
    assert index.apply_data(1, 0, BlocksStored(parent_hash=5, blocks=[StoredBlock(3, 13)])) == "ok"
    assert index.apply_data(1, 0, BlocksRemoved(block_hashes=[5])) is EventStatus.OK
    assert index.find_matches([11, 12]) == {}
    # an id reused for another block drops the old block (and its descendants) first
    index.apply_data(1, 0, BlocksStored(parent_hash=None, blocks=chain))
    index.apply_data(1, 0, BlocksStored(parent_hash=None, blocks=[StoredBlock(1, 21)]))
    assert index.find_matches([11, 12]) == {}
    assert index.find_matches([21]) == {(1, 0): 1}
    assert index.tree_blocks == 1
    index.check_invariants()


def test_runs_split_and_merge_as_holders_change() -> None:
    index = KVIndexer()
    a = [StoredBlock(i, 100 + i) for i in range(8)]
    index.apply_data(1, 0, BlocksStored(parent_hash=None, blocks=a))
    assert index.num_nodes == 1  # one run of 8
    index.apply_data(2, 0, BlocksStored(parent_hash=None, blocks=a[:3]))  # shares 3: split
    index.apply_data(2, 0, BlocksStored(parent_hash=2, blocks=[StoredBlock(50, 7)]))  # diverges
    assert index.num_nodes == 3
    assert index.find_matches([100, 101, 102, 103]) == {(1, 0): 4, (2, 0): 3}
    assert index.find_matches([100, 101, 102, 7]) == {(1, 0): 3, (2, 0): 4}
    index.apply_data(1, 0, BlocksRemoved(block_hashes=[5]))  # worker 1 keeps 0..4
    assert index.find_matches([100 + i for i in range(8)]) == {(1, 0): 5, (2, 0): 3}
    index.remove_worker(2)  # runs of worker 1 merge back into one
    assert index.num_nodes == 1
    assert index.find_matches([100 + i for i in range(8)]) == {(1, 0): 5}
    index.check_invariants()


def test_raw_batches_apply_as_their_events() -> None:
    """``apply_raw`` (a pass's events in the raw form) gives what ``apply_events`` of the same
    events gives: statuses, counters, gaps, ids, blocks; in order, after a gap, while
    recovering, stale or from a rank never seen."""
    rng = random.Random(7)
    raw_index, index = KVIndexer(), KVIndexer()
    next_id = {0: rng.choice([0, 1]), 1: 5}
    for step in range(300):
        rank = rng.randrange(2)
        events = []
        for _ in range(rng.randrange(1, 4)):
            ids = [rng.randrange(40) for _ in range(rng.randrange(1, 4))]
            if rng.random() < 0.6:
                parent = None if rng.random() < 0.3 else rng.randrange(40)
                blocks = [(b, rng.randrange(4)) for b in ids]
                events.append(stored(next_id[rank] + len(events), parent, blocks, rank))
            else:
                data = BlocksRemoved(block_hashes=ids)
                eid = next_id[rank] + len(events)
                events.append(KVCacheEvent(event_id=eid, data=data, dp_rank=rank))
        r = rng.random()
        next_id[rank] += len(events) + (rng.randrange(1, 3) if r < 0.05 else 0)  # a lost batch
        if r > 0.95:
            next_id[rank] -= rng.randrange(1, 4)  # a stale replay
        assert raw_index.apply_raw(3, kv_raw.encode(events)) == index.apply_events(3, events)
        if rng.random() < 0.7 and index.is_recovering(3, rank):  # recovered by an empty dump
            dump = KVRecoveryResponse(
                worker_id=3, dp_rank=rank, events=[], is_dump=True, last_event_id=next_id[rank] - 1
            )
            assert raw_index.apply_recovery(dump) == index.apply_recovery(dump)
        assert raw_index.counters == index.counters, step
        for k in range(2):
            assert raw_index.last_event_id(3, k) == index.last_event_id(3, k)
            assert raw_index.is_recovering(3, k) == index.is_recovering(3, k)
            assert raw_index.digest(3, k) == index.digest(3, k)
    assert raw_index.apply_raw(3, b"") == []
    assert index.counters[EventStatus.GAP] and index.counters[EventStatus.BLOCK_NOT_FOUND]
    raw_index.check_invariants()

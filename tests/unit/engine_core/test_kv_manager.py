"""KVManager: refcounts, LRU eviction, promotion, KV events (and a brute-force model check)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo.engine_core._kv_fallback import KVManager as PyKVManager
from dynamo.engine_core.kv_manager import KVManager
from dynamo.protocol.kv_events import BlocksRemoved, BlocksStored, StoredBlock
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from tests.unit.engine_core.block_set import BlockSetSubscriber

BS = 4


def chain(tokens: list[int]) -> tuple[list[int], list[int]]:
    local = local_block_hashes(tokens, BS)
    return sequence_hashes(local), local


def test_use_stores_one_batched_event_with_parent_chain() -> None:
    kv = KVManager(10, dp_rank=3)
    seq, local = chain(list(range(12)))
    kv.use(seq[:1], local[:1])
    kv.use(seq, local)  # block 0 is a hit, blocks 1-2 are new
    events = kv.drain_events()
    assert [e.event_id for e in events] == [0, 1]
    assert all(e.dp_rank == 3 for e in events)
    assert events[0].data == BlocksStored(parent_hash=None, blocks=[StoredBlock(seq[0], local[0])])
    assert events[1].data == BlocksStored(
        parent_hash=seq[0], blocks=[StoredBlock(seq[1], local[1]), StoredBlock(seq[2], local[2])]
    )
    assert [kv.refcount(h) for h in seq] == [2, 1, 1]
    assert kv.drain_events() == []
    kv.check_invariants()


def test_release_keeps_blocks_cached_and_hits_do_not_reannounce() -> None:
    kv = KVManager(10)
    seq, local = chain(list(range(8)))
    kv.use(seq, local)
    kv.release(seq, [])
    assert kv.num_active_blocks == 0 and kv.num_inactive_blocks == 2
    assert kv.num_cached_prefix(seq) == 2
    kv.drain_events()
    kv.use(seq, local)  # revived from the inactive pool: no event
    assert kv.drain_events() == []
    assert kv.num_cached_prefix(chain([0, 1, 2, 3, 9, 9, 9, 9])[0]) == 1
    kv.check_invariants()


def test_eviction_is_lru_and_emits_removed() -> None:
    kv = KVManager(3)
    a, la = chain([1] * 4)
    b, lb = chain([2] * 4)
    c, lc = chain([3] * 4)
    for h, lh in ((a, la), (b, lb), (c, lc)):
        kv.use(h, lh)
    kv.release(b, [])
    kv.release(a, [])  # a released after b: b is the least recently used
    kv.release(c, [])
    kv.use(a, la)  # touch a again (revived, then released: most recent)
    kv.release(a, [])
    kv.drain_events()
    d, ld = chain([4] * 4)
    kv.use(d, ld)
    events = kv.drain_events()
    assert events[0].data == BlocksRemoved(block_hashes=b)
    assert isinstance(events[1].data, BlocksStored)
    e, le = chain([5] * 4)
    kv.use(e, le)
    assert kv.drain_events()[0].data == BlocksRemoved(block_hashes=c)
    assert kv.is_cached(a[0]) and not kv.is_cached(b[0])
    kv.check_invariants()


def test_release_order_makes_leaves_evict_first() -> None:
    kv = KVManager(3)
    seq, local = chain(list(range(12)))
    kv.use(seq, local)
    kv.release(seq, [])
    kv.drain_events()
    assert kv.allocate_unique(1) is not None
    assert kv.drain_events()[0].data == BlocksRemoved(block_hashes=[seq[2]])


def test_no_room() -> None:
    kv = KVManager(2)
    seq, local = chain(list(range(12)))
    with pytest.raises(RuntimeError):
        kv.use(seq, local)
    assert kv.num_active_blocks == 0 and kv.drain_events() == []
    ids = kv.allocate_unique(2)
    assert ids is not None and len(set(ids)) == 2
    assert kv.allocate_unique(1) is None
    assert kv.num_slots_needed(seq[:1], 1) == 2
    kv.release([], ids)
    assert kv.num_available_blocks == 2
    kv.check_invariants()


def test_promote_stores_new_block_or_collapses_onto_cached_one() -> None:
    kv = KVManager(5)
    seq, local = chain(list(range(8)))
    kv.use(seq[:1], local[:1])
    kv.drain_events()
    [tail] = kv.allocate_unique(1) or []
    kv.promote(tail, seq[1], local[1], seq[0])
    assert [e.data for e in kv.drain_events()] == [
        BlocksStored(parent_hash=seq[0], blocks=[StoredBlock(seq[1], local[1])])
    ]
    assert kv.num_active_blocks == 2
    # A second sequence with the same tokens collapses its tail onto the existing block.
    kv.use(seq[:1], local[:1])
    [tail2] = kv.allocate_unique(1) or []
    kv.promote(tail2, seq[1], local[1], seq[0])
    assert kv.drain_events() == []
    assert kv.refcount(seq[1]) == 2 and kv.num_active_blocks == 2
    kv.check_invariants()


def test_prefix_caching_off_has_no_hits_and_no_events() -> None:
    kv = KVManager(4, enable_prefix_caching=False)
    seq, local = chain(list(range(8)))
    assert kv.num_cached_prefix(seq) == 0
    with pytest.raises(RuntimeError):
        kv.use(seq, local)
    ids = kv.allocate_unique(2) or []
    kv.release([], ids)
    assert kv.drain_events() == [] and kv.num_active_blocks == 0
    kv.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    kv = PyKVManager(2)  # the Python twin's state is reachable to corrupt; the C table's is not
    seq, local = chain(list(range(4)))
    kv.use(seq, local)
    kv._inactive[seq[0]] = None  # corrupt: a block both active and inactive
    with pytest.raises(AssertionError):
        kv.check_invariants()


# -- property test against a brute-force model ----------------------------------------------
class BruteKV:
    """Obviously-correct model: refcount dict, LRU list, unique count."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.active: dict[int, int] = {}
        self.lru: list[int] = []  # oldest first
        self.unique = 0

    def room(self, n: int) -> None:
        while len(self.active) + self.unique + len(self.lru) + n > self.capacity:
            self.lru.pop(0)

    def use(self, hashes: list[int]) -> None:
        new = [h for h in hashes if h not in self.active and h not in self.lru]
        for h in hashes:
            if h in self.lru:
                self.lru.remove(h)
            if h not in new:
                self.active[h] = self.active.get(h, 0) + 1
        self.room(len(new))
        for h in new:
            self.active[h] = 1

    def release(self, hashes: list[int], n_unique: int) -> None:
        self.unique -= n_unique
        for h in reversed(hashes):
            self.active[h] -= 1
            if self.active[h] == 0:
                del self.active[h]
                self.lru.append(h)

    def promote(self, h: int) -> None:
        self.unique -= 1
        if h in self.lru:
            self.lru.remove(h)
        self.active[h] = self.active.get(h, 0) + 1


# Four documents sharing prefixes, so that chains overlap.
DOCS = [[1] * 8 + [2] * 16, [1] * 8 + [3] * 16, [4] * 24, [1] * 4 + [5] * 20]
CHAINS = [chain(d) for d in DOCS]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("use"), st.integers(0, 3), st.integers(1, 5), st.integers(0, 1)),
        st.tuples(st.just("release"), st.integers(0, 20), st.just(0), st.just(0)),
        st.tuples(st.just("promote"), st.integers(0, 20), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(3, 12), script=ops)
def test_events_rebuild_the_block_set_like_a_brute_force_model(
    capacity: int, script: list[tuple[str, int, int, int]]
) -> None:
    kv, model, sub = KVManager(capacity), BruteKV(capacity), BlockSetSubscriber()
    held: list[tuple[int, list[int], list[int]]] = []  # (doc, full hashes, unique ids)
    for op, a, b, c in script:
        if op == "use":
            seq, local = CHAINS[a]
            hashes, local = seq[:b], local[:b]
            if kv.num_slots_needed(hashes, c) > kv.num_available_blocks:
                continue
            kv.use(hashes, local)
            model.use(hashes)
            ids = kv.allocate_unique(c) if c else []
            assert ids is not None
            model.room(c)
            model.unique += c
            held.append((a, list(hashes), ids))
        elif op == "release" and held:
            doc, hashes, ids = held.pop(a % len(held))
            kv.release(hashes, ids)
            model.release(hashes, len(ids))
        elif op == "promote" and held:
            doc, hashes, ids = held[a % len(held)]
            seq, local = CHAINS[doc]
            k = len(hashes)
            if not ids or k >= len(seq):
                continue
            kv.promote(ids.pop(), seq[k], local[k], seq[k - 1] if k else None)
            model.promote(seq[k])
            hashes.append(seq[k])
        sub.apply(kv.drain_events())
        kv.check_invariants()
        assert sub.blocks == kv.cached_blocks() == set(model.active) | set(model.lru)
        assert {h: kv.refcount(h) for h in model.active} == model.active
        assert kv.num_inactive_blocks == len(model.lru)
    for _, hashes, ids in held:
        kv.release(hashes, ids)
    assert kv.num_active_blocks == 0


def test_received_blocks_are_cached_but_never_announced() -> None:
    """A decode worker's blocks received from a prefill worker: no Stored event, and no Removed
    event when they are evicted; blocks it computes itself are announced as usual."""
    kv = KVManager(3)
    seq, local = chain(list(range(8)))
    kv.use(seq, local, announce=False)
    assert kv.drain_events() == []
    assert kv.num_cached_prefix(seq) == 2  # a later local request still hits them
    kv.release(seq, [])
    other, other_local = chain(list(range(100, 112)))
    kv.use(other, other_local)  # evicts the two received blocks
    events = kv.drain_events()
    assert [type(e.data) for e in events] == [BlocksStored]
    kv.check_invariants()

"""LocalKVIndex: event numbering, bounded buffer, tail vs dump recovery, router ingestion."""

from __future__ import annotations

import random

import pytest

from dynamo.protocol.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    KVRecoveryRequest,
    StoredBlock,
)
from dynamo.router.indexer import EventStatus, KVIndexer
from dynamo.router.local_index import LocalKVIndex


def store(parent: int | None, *blocks: tuple[int, int]) -> BlocksStored:
    return BlocksStored(parent_hash=parent, blocks=[StoredBlock(b, h) for b, h in blocks])


def state(events: list[KVCacheEvent]) -> dict[int, tuple[int, ...]]:
    """Canonical view of a dump: external id -> the full path of local hashes to its block."""
    path: dict[int, tuple[int, ...]] = {}
    for ev in events:
        assert isinstance(ev.data, BlocksStored)
        cur = () if ev.data.parent_hash is None else path[ev.data.parent_hash]
        for blk in ev.data.blocks:
            cur = path[blk.block_hash] = (*cur, blk.tokens_hash)
    return path


def engine_events(
    local: LocalKVIndex, rng: random.Random, n: int, rank: int = 0
) -> list[KVCacheEvent]:
    """Record n random engine events: chains under held blocks, removals, rare clears."""
    out = []
    for _ in range(n):
        held = list(state(local.dump_events(rank)))
        r = rng.random()
        if r < 0.6 or not held:
            parent = rng.choice(held) if held and rng.random() < 0.7 else None
            blocks = [(rng.getrandbits(32), rng.randrange(4)) for _ in range(rng.randint(1, 3))]
            out.append(local.record(store(parent, *blocks), rank))
        elif r < 0.97:
            out.append(local.record(BlocksRemoved(block_hashes=[rng.choice(held)]), rank))
        else:
            out.append(local.record(AllBlocksCleared(), rank))
        local.check_invariants()
    return out


def same_view(router: KVIndexer, local: LocalKVIndex, worker: int, rank: int = 0) -> None:
    router.check_invariants()
    assert state(router.dump_events(worker, rank)) == state(local.dump_events(rank))
    assert router.num_blocks(worker, rank) == local.num_blocks(rank)


def test_record_numbers_events_per_rank() -> None:
    local = LocalKVIndex(7)
    e0 = local.record(store(None, (1, 11)))
    e1 = local.record(store(1, (2, 12)))
    r0 = local.record(store(None, (1, 11)), dp_rank=1)
    assert (e0.event_id, e1.event_id, r0.event_id, r0.dp_rank) == (0, 1, 0, 1)
    assert local.last_event_id(0) == 1 and local.last_event_id(1) == 0
    assert LocalKVIndex(7, first_event_id=1).record(AllBlocksCleared()).event_id == 1
    with pytest.raises(ValueError):
        local.apply(KVCacheEvent(event_id=1, data=AllBlocksCleared()))
    with pytest.raises(ValueError):
        LocalKVIndex(1, first_event_id=5)


def test_tail_when_buffered_dump_otherwise() -> None:
    local = LocalKVIndex(7, buffer_size=4)
    for i in range(6):  # ids 0..5, buffer keeps 2..5
        local.record(store(None if i == 0 else i - 1, (i, 100 + i)))
    tail = local.answer(KVRecoveryRequest(start_event_id=3))
    assert not tail.is_dump and [e.event_id for e in tail.events] == [3, 4, 5]
    assert tail.last_event_id == 5 and tail.worker_id == 7
    up_to_date = local.answer(KVRecoveryRequest(start_event_id=6))
    assert not up_to_date.is_dump and up_to_date.events == []
    for start in (None, 1, 7):  # no id, older than the buffer, newer than anything sent
        dump = local.answer(KVRecoveryRequest(start_event_id=start))
        assert dump.is_dump and dump.last_event_id == 5
        assert all(e.event_id == 0 for e in dump.events)
    empty = LocalKVIndex(8, buffer_size=0)
    empty.record(store(None, (1, 11)))
    assert empty.answer(KVRecoveryRequest(start_event_id=0)).is_dump
    never = LocalKVIndex(9).answer(KVRecoveryRequest(dp_rank=3))
    assert never.is_dump and never.events == [] and never.last_event_id is None


def test_jump_in_ids_forces_dump_for_older_tails() -> None:
    local = LocalKVIndex(7)
    local.apply(KVCacheEvent(event_id=0, data=store(None, (1, 11))))
    local.apply(KVCacheEvent(event_id=5, data=store(1, (2, 12))))  # engine lost 1..4
    assert local.answer(KVRecoveryRequest(start_event_id=1)).is_dump
    assert [e.event_id for e in local.answer(KVRecoveryRequest(start_event_id=5)).events] == [5]
    local.check_invariants()


@pytest.mark.parametrize("seed", range(8))
def test_router_ingesting_a_dump_equals_the_worker(seed: int) -> None:
    rng = random.Random(seed)
    local = LocalKVIndex(3, buffer_size=8)
    engine_events(local, rng, 60, rank=0)
    engine_events(local, rng, 30, rank=1)
    assert local.dp_ranks() == [0, 1]
    router = KVIndexer()
    for rank in (0, 1):  # a router that starts after its workers
        resp = local.answer(router.recovery_request(3, rank))
        assert resp.is_dump
        assert router.apply_recovery(resp) is EventStatus.OK
        same_view(router, local, 3, rank)
    assert router.counters[EventStatus.PARENT_BLOCK_NOT_FOUND] == 0


@pytest.mark.parametrize("seed", range(8))
def test_router_recovers_from_lost_events(seed: int) -> None:
    """Live events with random losses; each gap is repaired from the local index (tail or dump)."""
    rng = random.Random(seed)
    local = LocalKVIndex(4, buffer_size=rng.choice([2, 16]))
    router = KVIndexer()
    recoveries = 0
    for _ in range(60):
        (ev,) = engine_events(local, rng, 1)
        if rng.random() < 0.2:
            continue  # lost on the event plane
        if router.apply(4, ev) is EventStatus.GAP:
            while True:
                recoveries += 1
                resp = local.answer(router.recovery_request(4))
                if router.apply_recovery(resp) is EventStatus.OK:
                    break
        if router.last_event_id(4) == local.last_event_id():
            same_view(router, local, 4)
    assert recoveries > 0
    router.apply_recovery(local.answer(router.recovery_request(4)))  # catch up on trailing losses
    assert router.last_event_id(4) == local.last_event_id()
    same_view(router, local, 4)

"""RoutingCore: the synchronous KV routing shared by the live router and the replay."""

from __future__ import annotations

import random

import pytest

from dynamo.protocol.kv_events import BlocksStored, KVCacheEvent, StoredBlock
from dynamo.router.config import KVRouterSettings
from dynamo.router.core import RoutingCore, WorkerSpec
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.runtime.errors import NoInstances, Overloaded

BS = 4


def _core(**settings: object) -> RoutingCore:
    core = RoutingCore(BS, KVRouterSettings(**settings), rng=random.Random(0))  # type: ignore[arg-type]
    for wid in (1, 2):
        core.add_worker(WorkerSpec(wid, 0, 1, total_kv_blocks=100))
    return core


def _stored(tokens: list[int], event_id: int = 0) -> KVCacheEvent:
    local = local_block_hashes(tokens, BS)
    seqs = sequence_hashes(local)
    blocks = [StoredBlock(block_hash=s, tokens_hash=h) for s, h in zip(seqs, local, strict=True)]
    return KVCacheEvent(event_id=event_id, data=BlocksStored(parent_hash=None, blocks=blocks))


def test_workers_come_from_membership_not_from_routing() -> None:
    core = _core()
    assert core.sequences.ranks() == [(1, 0), (2, 0)]
    assert not core.add_worker(WorkerSpec(1))  # already tracked
    assert core.remove_worker(2) and not core.remove_worker(2)
    chosen = core.route("a", local_block_hashes(list(range(8)), BS), 8)
    assert chosen.worker_id == 1
    with pytest.raises(NoInstances):
        core.route("b", [], 1, allowed={2})


def test_route_follows_the_indexed_prefix_and_counts_load() -> None:
    core = _core()
    tokens = list(range(16))
    assert core.apply_event(2, _stored(tokens)).value == "ok"
    local = local_block_hashes(tokens, BS)
    chosen = core.route("r1", local, len(tokens))
    assert (chosen.worker_id, chosen.overlap_blocks, chosen.cached_tokens) == (2, 4, 16)
    assert core.sequences.active_requests(2) == 1
    assert core.sequences.active_prefill_tokens(2) == 0  # every token was cached
    assert core.prefill_completed("r1") and core.free("r1") and not core.free("r1")
    assert core.sequences.active_requests(2) == 0


def test_load_balances_without_cache_hits() -> None:
    core = _core()
    first = core.route("r1", local_block_hashes(list(range(8)), BS), 8)
    second = core.route("r2", local_block_hashes(list(range(100, 108)), BS), 8)
    assert {first.worker_id, second.worker_id} == {1, 2}


def test_hints_and_duplicates() -> None:
    core = _core()
    local = local_block_hashes(list(range(8)), BS)
    assert core.route("r", local, 8, pinned_worker=2).worker_id == 2
    again = core.route("r", local, 8, pinned_worker=1)  # same id: routed, counted once
    assert again.worker_id == 1 and core.sequences.worker_of("r") == (2, 0)
    with pytest.raises(NoInstances, match="hints"):
        core.route("x", local, 8, dp_rank=3)


def test_record_with_the_prefix_keys_of_the_route() -> None:
    """The live router's split call: ``route(record=False)`` then ``record`` with the prefix
    keys it computed once counts the same load as ``route`` recording; a duplicate id or a rank
    that left is refused (False) and changes nothing."""
    local = local_block_hashes(list(range(40)), BS)
    seqs = sequence_hashes(local)
    recorded, split = _core(), _core()
    recorded.route("r", local, 40, seq_hashes=seqs)
    keys = split.prefix_keys(seqs)
    chosen = split.route("r", local, 40, seq_hashes=seqs, record=False, prefix_keys=keys)
    assert split.record("r", chosen, seqs, 40, local, keys)
    assert split.sequences.active_loads() == recorded.sequences.active_loads()
    assert not split.record("r", chosen, seqs, 40, local, keys)  # already active
    split.remove_worker(chosen.worker_id)
    assert not split.record("s", chosen, seqs, 40, local, keys)  # its rank left
    assert "s" not in split.sequences
    split.sequences.check_invariants()


def test_busy_workers_are_refused() -> None:
    core = _core(active_prefill_tokens_threshold=4)
    core.route("a", [], 10)
    core.route("b", [], 10)
    with pytest.raises(Overloaded):
        core.route("c", [], 10)


def test_approximate_mode_uses_the_injected_clock() -> None:
    now = [0.0]
    core = RoutingCore(
        BS, KVRouterSettings(use_kv_events=False, ttl_secs=10.0), clock=lambda: now[0]
    )
    core.add_worker(WorkerSpec(1))
    core.add_worker(WorkerSpec(2))
    local = local_block_hashes(list(range(8)), BS)
    first = core.route("a", local, 8)
    core.free("a")
    assert core.route("b", local, 8).worker_id == first.worker_id  # its own decision, cached
    core.free("b")
    now[0] = 11.0  # past the TTL: forgotten
    assert core.approx is not None and core.approx.find_matches(local) == {}


@pytest.mark.parametrize("seed", range(4))
def test_overlap_column_same_with_or_without_the_key_index(seed: int) -> None:
    """The choice over every target places each matched rank's blocks by its key's index; over
    a subset (``allowed``) it looks each target up: the same costs either way, and a match on a
    rank that is not a target (or not a rank at all) is ignored."""
    rng = random.Random(seed)
    core = RoutingCore(BS, KVRouterSettings(), rng=random.Random(seed))
    ids = list(range(1, 9))
    for wid in ids:
        core.add_worker(WorkerSpec(wid, 0, 1, total_kv_blocks=100))
    core.remove_worker(3)  # the index follows membership
    local = local_block_hashes(list(range(40)), BS)
    for k in range(30):
        overlaps = {
            (rng.choice(ids + [99]), rng.choice([0, 0, 1])): rng.randrange(1, 11) for _ in range(3)
        }
        every = core.route(f"a{k}", local, 40, overlaps=overlaps, record=False)
        subset = core.route(
            f"b{k}", local, 40, overlaps=overlaps, record=False, allowed=set(ids) - {3}
        )
        assert every.scored == subset.scored
        assert every.scores == subset.scores
        want = overlaps.get((every.worker_id, every.dp_rank), 0)
        assert every.overlap_blocks == want

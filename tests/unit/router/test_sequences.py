"""router/sequences.py: active-load accounting per (worker, dp_rank)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo.router.sequences import (
    ActiveLoad,
    ActiveSequences,
    DuplicateRequest,
    LoadProjection,
    PotentialLoad,
    UnknownWorkerRank,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(block_size: int = 16, **kwargs: object) -> ActiveSequences:
    seqs = ActiveSequences(block_size, **kwargs)  # type: ignore[arg-type]
    seqs.add_worker(7, (0, 1))
    return seqs


def load(seqs: ActiveSequences, worker: int = 7, rank: int = 0) -> tuple[int, int, int]:
    return (
        seqs.active_prefill_tokens(worker, rank),
        seqs.active_decode_blocks(worker, rank),
        seqs.active_requests(worker, rank),
    )


def test_overlapping_lifecycle_on_one_rank() -> None:
    seqs = make()
    seqs.add_request("a", 7, 0, [101, -22, 303], new_isl_tokens=48)
    assert load(seqs) == (48, 3, 1)
    seqs.add_request("b", 7, 0, [101, -22, 404], new_isl_tokens=40)
    assert load(seqs) == (88, 4, 2)  # 101 and -22 are shared: counted once
    assert seqs.mark_prefill_completed("a")
    assert load(seqs) == (40, 4, 2)  # prefill tokens leave, blocks stay
    assert seqs.mark_prefill_completed("a")  # a repeat is a no-op
    assert load(seqs) == (40, 4, 2)
    assert seqs.free("b")  # implicitly completes b's prefill
    assert load(seqs) == (0, 3, 1)  # 404 left; the shared blocks are still held by a
    assert not seqs.free("b")  # idempotent
    assert not seqs.mark_prefill_completed("b")
    assert seqs.free("a")
    assert load(seqs) == (0, 0, 0)
    assert load(seqs, rank=1) == (0, 0, 0)
    seqs.check_invariants()


def test_potential_loads_match_spec_example() -> None:
    seqs = make()
    seqs.add_request("req-122", 7, 0, [101, -22], new_isl_tokens=32)
    seqs.mark_prefill_completed("req-122")
    seqs.add_request("req-123", 7, 0, [101, -22, 303], new_isl_tokens=48)
    assert seqs.active_loads()[0] == ActiveLoad(7, 0, 48, 3, 2)
    loads = seqs.potential_loads([101, -22, 303, 404], 48)
    assert loads == [PotentialLoad(7, 0, 96, 4, 2), PotentialLoad(7, 1, 48, 4, 0)]
    projected = seqs.project_loads([101, -22, 303, 404])
    assert projected == [LoadProjection(7, 0, 48, 3, 1, 2), LoadProjection(7, 1, 0, 0, 4, 0)]
    seqs.check_invariants()


def decode_blocks(seqs: ActiveSequences, query: list[int]) -> int:
    return seqs.potential_loads(query)[0].potential_decode_blocks


def test_block_identity_is_positional_as_measured_on_the_reference() -> None:
    """FACTS §5.1: the vectors measured on the reference's slot tracker."""
    seqs = make()
    seqs.add_request("a", 7, 0, [5, 6, 7])
    assert seqs.active_decode_blocks(7, 0) == 3
    assert decode_blocks(seqs, [9, 6, 7]) == 6  # 6 and 7 after 9: not the active 6 and 7
    assert decode_blocks(seqs, [5, 7]) == 4
    assert decode_blocks(seqs, [5, 6, 7, 5]) == 4  # the second 5 sits at a new position
    seqs.add_request("b", 7, 0, [8, 6])
    assert seqs.active_decode_blocks(7, 0) == 5  # [8] and [8, 6] are new trie nodes
    assert decode_blocks(seqs, [8, 6, 7]) == 6
    seqs.check_invariants()


def test_repeated_query_blocks_count_per_position() -> None:
    seqs = make()
    seqs.add_request("a", 7, 0, [1, 2])
    assert decode_blocks(seqs, [2, 3, 3, 3]) == 6
    assert decode_blocks(seqs, [1, 2, 2]) == 3
    assert decode_blocks(seqs, []) == 2
    assert decode_blocks(seqs, iter([1, 3])) == 3  # any iterable


def test_repeated_hash_inside_one_request_is_refcounted() -> None:
    seqs = make()
    seqs.add_request("a", 7, 0, [5, 5, 6])
    seqs.add_request("b", 7, 0, [5])
    assert load(seqs) == (0, 3, 2)  # nodes [5], [5, 5], [5, 5, 6]; b shares [5]
    seqs.free("a")
    assert load(seqs) == (0, 1, 1)
    seqs.check_invariants()


def test_signed_and_unsigned_forms_name_the_same_block() -> None:
    seqs = make()
    seqs.add_request("a", 7, 0, [-1, 2**63])
    assert decode_blocks(seqs, [2**64 - 1, -(2**63)]) == 2
    assert seqs.free("a") and load(seqs) == (0, 0, 0)


def test_overlap_blocks_reduce_prefill_and_clamp_at_zero() -> None:
    seqs = make(block_size=16)
    seqs.add_request("a", 7, 0, [1, 2, 3], new_isl_tokens=50, overlap_blocks=2)
    assert seqs.active_prefill_tokens(7, 0) == 18
    seqs.add_request("b", 7, 0, [1], new_isl_tokens=10, overlap_blocks=3)
    assert seqs.active_prefill_tokens(7, 0) == 18
    assert not seqs.is_prefill_pending("b") and seqs.is_prefill_pending("a")
    seqs.check_invariants()


def test_errors_leave_state_unchanged() -> None:
    seqs = make()
    seqs.add_request("a", 7, 0, [1], new_isl_tokens=5)
    with pytest.raises(DuplicateRequest):
        seqs.add_request("a", 7, 1, [2], new_isl_tokens=5)
    with pytest.raises(UnknownWorkerRank):
        seqs.add_request("z", 7, 2, [2], new_isl_tokens=5)
    with pytest.raises(UnknownWorkerRank):
        seqs.add_request("z", 8, 0, [2], new_isl_tokens=5)
    assert load(seqs) == (5, 1, 1) and load(seqs, rank=1) == (0, 0, 0)
    assert seqs.request_ids() == ["a"] and "z" not in seqs
    seqs.check_invariants()


def test_add_routed_on_a_rank_of_rank_loads_is_add_request() -> None:
    """The router's record on the rank its route read (no lookup): the same state as
    ``add_request``; a duplicate id is refused (False) and changes nothing."""
    seqs, ref = make(), make()
    keys = [(7, 0), (7, 1)]
    ranks, _, _ = seqs.rank_loads([1, 2], keys)
    assert seqs.add_routed("a", ranks[1], [1, 2], 40, 1, None)
    ref.add_request("a", 7, 1, [1, 2], new_isl_tokens=40, overlap_blocks=1)
    assert not seqs.add_routed("a", ranks[0], [3], 5, 0, None)
    assert [load(s, rank=r) for s in (seqs, ref) for r in (0, 1)] == [(0, 0, 0), (24, 2, 1)] * 2
    assert seqs.worker_of("a") == (7, 1)
    seqs.check_invariants()


def test_arrival_order_and_worker_lookup() -> None:
    seqs = make()
    for rid in ("c", "a", "b"):
        seqs.add_request(rid, 7, 1, [])
    seqs.free("a")
    seqs.add_request("a", 7, 0, [])
    assert seqs.request_ids() == ["c", "b", "a"]
    assert seqs.worker_of("a") == (7, 0) and seqs.worker_of("c") == (7, 1)
    assert seqs.worker_of("zz") is None and len(seqs) == 3


def test_remove_worker_frees_its_requests_only() -> None:
    seqs = make()
    seqs.add_worker(8)
    seqs.add_request("a", 7, 0, [1, 2], new_isl_tokens=10)
    seqs.add_request("b", 8, 0, [1, 2], new_isl_tokens=10)
    seqs.add_request("c", 7, 1, [3], new_isl_tokens=10)
    assert seqs.remove_worker(7) == ["a", "c"]
    assert seqs.ranks() == [(8, 0)] and not seqs.has_rank(7, 0)
    assert seqs.request_ids() == ["b"] and load(seqs, 8) == (10, 2, 1)
    assert seqs.remove_worker(7) == []
    with pytest.raises(UnknownWorkerRank):
        seqs.add_request("d", 7, 0, [])
    seqs.add_worker(8, (0, 1))  # re-adding an existing rank keeps its state
    assert load(seqs, 8) == (10, 2, 1) and seqs.ranks() == [(8, 0), (8, 1)]
    assert seqs.remove_worker(8, [1]) == [] and seqs.ranks() == [(8, 0)]
    seqs.check_invariants()


def test_no_kv_reuse_never_dedups() -> None:
    seqs = make(assume_kv_reuse=False)
    seqs.add_request("a", 7, 0, [1, 2, 3])
    seqs.add_request("b", 7, 0, [1, 2, 3])
    assert seqs.active_decode_blocks(7, 0) == 6
    assert seqs.potential_loads([1, 2])[0].potential_decode_blocks == 8
    seqs.check_invariants()
    seqs.free("a")
    assert seqs.active_decode_blocks(7, 0) == 3
    seqs.check_invariants()


def test_stale_requests_expire_with_injected_clock() -> None:
    clock = FakeClock()
    seqs = make(expiry_s=300.0, expiry_check_interval_s=30.0, clock=clock)
    seqs.add_request("old", 7, 0, [1], new_isl_tokens=8)
    clock.now += 200
    seqs.add_request("mid", 7, 0, [1, 2], new_isl_tokens=8)
    clock.now += 101  # "old" is now 301 s old, "mid" 101 s
    seqs.add_request("new", 7, 1, [9])  # the check runs on add: "old" goes
    assert seqs.request_ids() == ["mid", "new"]
    assert load(seqs) == (8, 2, 1)
    clock.now += 200  # "mid" is now 301 s old; the last check was 200 s ago
    seqs.add_request("newer", 7, 1, [])
    assert seqs.request_ids() == ["new", "newer"]
    clock.now += 299.5
    seqs.add_request("x", 7, 1, [])  # "new" is 499.5 s old -> expired; "newer" 299.5 s -> kept
    assert seqs.request_ids() == ["newer", "x"]
    seqs.check_invariants()


def test_expiry_is_checked_at_most_every_interval() -> None:
    clock = FakeClock()
    seqs = make(expiry_s=10.0, expiry_check_interval_s=30.0, clock=clock)
    clock.now += 31
    seqs.add_request("a", 7, 0, [])  # runs a check (nothing stale); next one not before +30 s
    clock.now += 20
    seqs.add_request("b", 7, 0, [])
    assert seqs.request_ids() == ["a", "b"]  # "a" is 20 s old but no check ran
    assert seqs.expire_stale() == ["a"]  # an explicit sweep always runs
    clock.now += 30
    seqs.add_request("c", 7, 0, [])
    assert seqs.request_ids() == ["c"]


def test_check_invariants_detects_corruption() -> None:
    seqs = make()
    seqs.add_request("a", 7, 0, [1, 2], new_isl_tokens=4)
    seqs.check_invariants()
    seqs._ranks[(7, 0)].blocks.add([1])  # simulate a bookkeeping bug
    with pytest.raises(AssertionError):
        seqs.check_invariants()


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError):
        ActiveSequences(0)
    with pytest.raises(ValueError):
        ActiveSequences(16, expiry_s=0)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "prefill", "free"]),
        st.integers(0, 7),  # request id
        st.integers(0, 2),  # rank
        st.lists(st.integers(-3, 3), max_size=5),  # hashes (small domain: lots of sharing,
        # the same hash at other positions and after other prefixes)
        st.integers(0, 64),  # isl
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.lists(st.integers(-3, 4), max_size=6), st.booleans())
def test_matches_brute_force_model(
    ops: list[tuple[str, int, int, list[int], int]], query: list[int], reuse: bool
) -> None:
    seqs = ActiveSequences(4, assume_kv_reuse=reuse)
    seqs.add_worker(1, (0, 1, 2))
    model: dict[str, tuple[int, list[int], int]] = {}  # id -> (rank, hashes, pending prefill)
    for op, n, rank, hashes, isl in ops:
        rid = f"r{n}"
        if op == "add":
            if rid in model:
                with pytest.raises(DuplicateRequest):
                    seqs.add_request(rid, 1, rank, hashes, new_isl_tokens=isl)
            else:
                seqs.add_request(rid, 1, rank, hashes, new_isl_tokens=isl)
                model[rid] = (rank, hashes, isl)
        elif op == "prefill":
            assert seqs.mark_prefill_completed(rid) == (rid in model)
            if rid in model:
                model[rid] = (model[rid][0], model[rid][1], 0)
        else:
            assert seqs.free(rid) == (rid in model)
            model.pop(rid, None)
        seqs.check_invariants()
    for rank in range(3):
        mine = [v for v in model.values() if v[0] == rank]
        if reuse:  # the trie of active sequences: one node per distinct prefix
            active = {tuple(v[1][: i + 1]) for v in mine for i in range(len(v[1]))}
            blocks = len(active)
            new_blocks = sum(tuple(query[: i + 1]) not in active for i in range(len(query)))
        else:
            blocks = sum(len(v[1]) for v in mine)
            new_blocks = len(query)
        prefill = sum(v[2] for v in mine)
        assert load(seqs, 1, rank) == (prefill, blocks, len(mine))
        assert seqs.potential_loads(query, 5)[rank] == PotentialLoad(
            1, rank, prefill + 5, blocks + new_blocks, len(mine)
        )
        assert seqs.project_loads(query)[rank] == LoadProjection(
            1, rank, prefill, blocks, new_blocks, len(mine)
        )
        if reuse:  # queries that follow active paths part of the way, then leave them
            for v in model.values():
                probe = v[1][: len(v[1]) // 2 + 1] + query
                expected = sum(tuple(probe[: i + 1]) not in active for i in range(len(probe)))
                got = seqs.project_loads(probe)[rank].new_decode_blocks
                assert got == expected, (probe, active)
    assert seqs.request_ids() == [rid for rid in model]


def test_load_columns_follow_every_change_as_project_loads() -> None:
    """The kept columns (every rank in rank-list order, refreshed per changed rank) equal the
    figures read from the ranks, through adds, prefill completions, frees, expiry, ranks coming
    and going, other key orders and subsets, with and without KV reuse."""
    import random

    rng = random.Random(11)
    for reuse in (True, False):
        clock = FakeClock()
        seqs = ActiveSequences(4, assume_kv_reuse=reuse, clock=clock, expiry_s=50.0)
        seqs.add_worker(1, (0, 1))
        seqs.add_worker(2)
        keys = seqs.ranks()
        live: list[str] = []
        for step in range(400):
            op = rng.random()
            if op < 0.4 and keys:
                rid = f"r{step}"
                hashes = [rng.randrange(4) for _ in range(rng.randrange(6))]
                worker, rank = rng.choice(keys)
                seqs.add_request(rid, worker, rank, hashes, new_isl_tokens=rng.randrange(40))
                live.append(rid)
            elif op < 0.6 and live:
                seqs.mark_prefill_completed(rng.choice(live))
            elif op < 0.8 and live:
                seqs.free(live.pop(rng.randrange(len(live))))
            elif op < 0.85:
                clock.now += rng.choice([1.0, 40.0])
            elif op < 0.9:
                worker = rng.choice([1, 2, 3])
                if rng.random() < 0.5:
                    seqs.add_worker(worker, (0, 1))
                else:
                    seqs.remove_worker(worker)
                keys = seqs.ranks()  # a new list: resolved again
            query = [rng.randrange(4) for _ in range(rng.randrange(6))]
            for asked in (keys, keys[::-1], keys[1:]):
                got = seqs.load_columns(query, asked)
                loads = {(p.worker_id, p.dp_rank): p for p in seqs.project_loads(query)}
                want = tuple(
                    [getattr(loads[k], f) for k in asked]
                    for f in (
                        "active_prefill_tokens",
                        "active_decode_blocks",
                        "new_decode_blocks",
                        "active_requests",
                    )
                )
                assert got == want, step
            seqs.check_invariants()

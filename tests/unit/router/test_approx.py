"""ApproxIndex: routing decisions recorded with a TTL, refreshed, pruned lazily."""

from __future__ import annotations

import random

import pytest

from dynamo.router.approx import DEFAULT_TTL_S, ApproxIndex
from dynamo.router.hashing import sequence_hashes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_default_ttl_is_120s() -> None:
    assert DEFAULT_TTL_S == 120.0
    assert ApproxIndex().ttl_s == 120.0
    with pytest.raises(ValueError):
        ApproxIndex(0)


def test_records_match_until_they_expire() -> None:
    clock = FakeClock()
    idx = ApproxIndex(120, clock=clock)
    idx.record(1, 0, [11, 12, 13])
    idx.record(2, 1, [11, 12])
    assert idx.find_matches([11, 12, 13, 14]) == {(1, 0): 3, (2, 1): 2}
    clock.now += 119.9
    assert idx.find_matches([11, 12, 13]) == {(1, 0): 3, (2, 1): 2}
    clock.now += 0.1  # expiry is inclusive: now >= recorded + ttl
    assert idx.find_matches([11, 12, 13]) == {}
    assert idx.num_nodes == 0 and idx.num_blocks(1, 0) == 0
    idx.check_invariants()


def test_refresh_extends_only_the_recorded_path() -> None:
    clock = FakeClock()
    idx = ApproxIndex(100, clock=clock)
    idx.record(1, 0, [11, 12, 13, 14])
    clock.now += 60
    idx.record(1, 0, [11, 12])  # refreshes 11, 12 only
    clock.now += 50  # the first record expired, the refresh has not
    assert idx.find_matches([11, 12, 13, 14]) == {(1, 0): 2}
    assert idx.num_blocks(1, 0) == 2
    clock.now += 50
    assert idx.find_matches([11, 12]) == {}
    idx.check_invariants()


def test_extending_a_recorded_prefix_and_branching() -> None:
    clock = FakeClock()
    idx = ApproxIndex(100, clock=clock)
    idx.record(1, 0, [11, 12])
    idx.record(1, 0, [11, 12, 13, 14])  # stores only 13, 14 under the held prefix
    idx.record(1, 0, [11, 22])
    assert idx.find_matches([11, 12, 13, 14]) == {(1, 0): 4}
    assert idx.find_matches([11, 22]) == {(1, 0): 2}
    assert idx.num_blocks(1, 0) == 5
    idx.check_invariants()


def test_explicit_prune_and_worker_removal() -> None:
    clock = FakeClock()
    idx = ApproxIndex(10, clock=clock)
    idx.record(1, 0, [1, 2, 3])
    idx.record(1, 1, [1, 2])
    idx.record(2, 0, [5])
    assert idx.prune(clock.now + 5) == 0
    assert idx.prune(clock.now + 10) == 6
    idx.record(1, 0, [1, 2, 3])
    idx.record(1, 1, [1])
    idx.record(2, 0, [1, 2])
    idx.remove_worker(1)
    assert idx.find_matches([1, 2, 3]) == {(2, 0): 2}
    idx.clear(2, 0)
    assert idx.find_matches([1]) == {}
    assert idx.num_nodes == 0
    clock.now += 100
    assert idx.prune() == 0  # stale heap entries are skipped
    idx.check_invariants()


def test_seq_hashes_may_be_passed() -> None:
    idx = ApproxIndex(10, clock=FakeClock())
    local = [7, 8, 9]
    idx.record(3, 0, local, seq_hashes=sequence_hashes(local))
    assert idx.find_matches(local) == {(3, 0): 3}
    with pytest.raises(ValueError):
        idx.record(3, 0, local, seq_hashes=[1])


@pytest.mark.parametrize("seed", range(5))
def test_against_brute_force_over_time(seed: int) -> None:
    """Model: per (worker, rank) the expiry of every recorded prefix path."""
    rng = random.Random(seed)
    clock = FakeClock()
    idx = ApproxIndex(30, clock=clock)
    model: dict[tuple[int, int], dict[tuple[int, ...], float]] = {}
    keys = [(1, 0), (1, 1), (2, 0)]
    for _ in range(300):
        clock.now += rng.choice([0.0, 0.5, 3.0, 10.0])
        key = rng.choice(keys)
        path = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
        idx.record(*key, path)
        exp = model.setdefault(key, {})
        for k in range(1, len(path) + 1):
            exp[tuple(path[:k])] = clock.now + 30
        q = [rng.randrange(3) for _ in range(5)]
        expected = {}
        for k2, paths in model.items():
            n = 0
            while n < len(q) and paths.get(tuple(q[: n + 1]), 0.0) > clock.now:
                n += 1
            if n:
                expected[k2] = n
        assert idx.find_matches(q) == expected
        live = {k2: sum(1 for e in p.values() if e > clock.now) for k2, p in model.items()}
        for k2 in keys:
            assert idx.num_blocks(*k2) == live.get(k2, 0)
        idx.check_invariants()

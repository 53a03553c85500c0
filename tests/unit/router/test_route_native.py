"""router/_route.c against its fallback (``_route_fallback.py``) on randomized inputs, and the
router core's one-call path (``RoutingCore._choose``) against the per-``Candidate`` one
(``select_worker``): the same choices, costs bit for bit, the same draws from the generator."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

from dynamo.protocol.kv_events import BlocksStored, KVCacheEvent, StoredBlock
from dynamo.router import _route_fallback as py
from dynamo.router.config import KVRouterSettings
from dynamo.router.core import RoutingCore, WorkerSpec
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.router.selector import select_worker

PARAMS = [
    (1.0, 1.0, 0.0, 0.0, True),  # the defaults
    (0.7, 0.5, 0.3, 2.0, True),  # credit decay and a request weight
    (1.0, 1.0, 0.0, 1.0, False),  # decode-only, with credit
    (0.0, 1.0, 1.5, 0.0, False),  # decode-only, no credit
]


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.router._route")


@dataclass(slots=True, eq=False)
class SlottedRank:  # read at its slot offsets
    prefill_tokens: int
    private_blocks: int
    num_requests: int
    blocks: list[int]


class PlainRank:  # read through getattr
    def __init__(self, prefill: int, private: int, requests: int, blocks: list[int]) -> None:
        self.prefill_tokens, self.private_blocks = prefill, private
        self.num_requests, self.blocks = requests, blocks


def inputs(rng: random.Random, n: int, by_slot: bool) -> tuple[Any, ...]:
    """A random call: n targets (ties likely), matches for some of them and for non-targets."""
    kind = SlottedRank if rng.random() < 0.7 else PlainRank
    small = [0, 0, 1, 2, rng.choice([-3, 2**40, True])]  # (odd ints: the API's conversion)
    ranks = [
        kind(
            rng.choice(small + [rng.randrange(3000)]),
            rng.choice(small),
            rng.choice(small + [rng.randrange(40)]),
            [0] * rng.choice([0, 1, 2, rng.randrange(300)]),
        )
        for _ in range(n)
    ]
    keys = [(100 + i // 2, i % 2) for i in range(n + 3)]  # the last three are not targets
    place_of = {key: i for i, key in enumerate(keys[:n])}
    matched = rng.sample(range(n + 3), rng.randrange(min(n + 3, 6)))
    key_of: list[tuple[int, int]] | None = None
    if by_slot:
        key_of = keys[::-1]  # slot s names keys[-1 - s]
        matches = {len(keys) - 1 - k: rng.randrange(1, 80) for k in matched}
    else:
        matches = {keys[k]: rng.randrange(1, 80) for k in matched}
    new = [rng.choice(small + [rng.randrange(80)]) for _ in range(n)]
    return matches, key_of, place_of, ranks, new


@pytest.mark.parametrize("params", PARAMS)
def test_choices_match_the_fallback(native: ModuleType, params: tuple[Any, ...]) -> None:
    rng = random.Random(hash(params) & 0xFFFF)
    for n in (1, 2, 4, 17, 100):
        for trial in range(30):
            matches, key_of, place_of, ranks, new = inputs(rng, n, by_slot=trial % 2 == 0)
            isl, bs, track = rng.randrange(0, 3000), rng.choice([1, 16, 64]), trial % 5 != 0
            a, b = random.Random(trial), random.Random(trial)
            got = native.choose(matches, key_of, place_of, ranks, new, isl, bs, params, a, track)
            want = py.choose(matches, key_of, place_of, ranks, new, isl, bs, params, b, track)
            assert got[:2] == want[:2]
            assert [c.hex() for c in got[2]] == [c.hex() for c in want[2]]  # bit for bit
            assert a.getstate() == b.getstate()  # the same draws


def test_every_target_tied_draws_as_randrange_does(native: ModuleType) -> None:
    ranks = [SlottedRank(0, 0, 0, []) for _ in range(100)]
    place_of = {(i, 0): i for i in range(100)}
    for seed in range(5):
        a, b = random.Random(seed), random.Random(seed)
        args: tuple[Any, ...] = ({}, None, place_of, ranks, [3] * 100, 64, 16, PARAMS[0])
        assert native.choose(*args, a, True) == py.choose(*args, b, True)
        assert a.getstate() == b.getstate()


@pytest.mark.parametrize("module", ["native", "fallback"])
def test_bad_input_is_refused(native: ModuleType, module: str) -> None:
    impl = native if module == "native" else py
    rank, rng, p = SlottedRank(0, 0, 0, []), random.Random(0), PARAMS[0]
    with pytest.raises(ValueError, match="at least one target"):
        impl.choose({}, None, {}, [], [], 16, 16, p, rng, True)
    with pytest.raises(ValueError, match="one item per rank"):
        impl.choose({}, None, {}, [rank], [0, 0], 16, 16, p, rng, True)
    with pytest.raises(ValueError, match="block_size"):
        impl.choose({}, None, {}, [rank], [0], 16, 0, p, rng, True)
    with pytest.raises(IndexError, match="slot"):
        impl.choose({5: 1}, [(1, 0)], {(1, 0): 0}, [rank], [0], 16, 16, p, rng, True)
    with pytest.raises(IndexError, match="place"):
        impl.choose({(1, 0): 1}, None, {(1, 0): 3}, [rank], [0], 16, 16, p, rng, True)
    with pytest.raises(AttributeError):
        impl.choose({}, None, {}, [object()], [0], 16, 16, p, rng, True)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"overlap_score_credit_decay": 1.5, "decode_active_request_weight": 0.25},
        {"track_prefill_tokens": False},
        {"track_active_blocks": False},
        {"assume_kv_reuse": False},
        {"use_kv_events": False},
    ],
)
def test_one_call_path_chooses_as_the_candidate_path(settings: dict[str, object]) -> None:
    """A core routing every request in one kernel call (every target eligible; the index's
    matches found by the core, or handed in as the live router does) scores the state as
    ``Candidate`` objects and ``select_worker`` do."""
    kv = KVRouterSettings(**settings)  # type: ignore[arg-type]
    core = RoutingCore(4, kv, rng=random.Random(3), clock=lambda: 0.0)
    twin_rng = random.Random(3)
    for wid in range(6):
        core.add_worker(WorkerSpec(100 + wid, 0, 2 if wid % 2 else 1, total_kv_blocks=64))
    rng, hits = random.Random(11), 0
    prefixes = [[rng.randrange(1000) for _ in range(24)] for _ in range(3)]
    for wid, prefix in ((101, prefixes[0]), (102, prefixes[1]), (104, prefixes[0][:12])):
        local = local_block_hashes(prefix, 4)
        blocks = [
            StoredBlock(block_hash=s, tokens_hash=h)
            for s, h in zip(sequence_hashes(local), local, strict=True)
        ]
        stored = KVCacheEvent(event_id=0, data=BlocksStored(parent_hash=None, blocks=blocks))
        assert core.apply_event(wid, stored).value == "ok"  # cached prefixes: overlaps > 0
    for i in range(60):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(9))]
        local = local_block_hashes(tokens, 4)
        seqs = sequence_hashes(local)
        options = core._candidates(core._targets, seqs, core.find_matches(local))  # noqa: SLF001
        want = select_worker(options, len(tokens), 4, core.selector, twin_rng)
        if i % 2:  # as the live router calls it: every worker allowed, its own matches
            allowed = set(core.workers) | {999}
            found = core.find_matches(local)
            got = core.route(
                f"r{i}", local, len(tokens), seq_hashes=seqs, allowed=allowed, overlaps=found
            )
        else:
            got = core.route(f"r{i}", local, len(tokens), seq_hashes=seqs)
        assert got == want
        hits += got.overlap_blocks > 0
        if i % 3 == 0:
            core.prefill_completed(f"r{i // 2}")
        if i % 4 == 0:
            core.free(f"r{i // 3}")
    assert core.rng.getstate() == twin_rng.getstate()
    assert hits > 5
    core.sequences.check_invariants()


def test_whole_target_calls_are_told_apart() -> None:
    """The kernel's call covers every target: a worker left out of ``allowed`` (a list or a
    set) or a pin narrows the targets, and only those are scored."""
    core = RoutingCore(4, KVRouterSettings(), rng=random.Random(0))
    for wid in (1, 2, 3):
        core.add_worker(WorkerSpec(wid))
    local = local_block_hashes(list(range(16)), 4)
    for allowed in ([1, 2, 3], {1, 2, 3}, None):
        got = core.route("a", local, 16, allowed=allowed, record=False)
        assert [key for key in got.scored] == [(1, 0), (2, 0), (3, 0)]
    for allowed in ([1, 3], {3, 1}):
        got = core.route("a", local, 16, allowed=allowed, record=False)
        assert list(got.scored) == [(1, 0), (3, 0)]
    assert core.route("a", local, 16, pinned_worker=2, record=False).worker_id == 2

"""router/_cost.c against its fallback (``_cost_fallback.py``), and the router core's column
path (``RoutingCore._select``) against the per-``Candidate`` one (``select_worker``): the same
costs bit for bit, the same choices, the same draws from the random generator."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from dynamo.protocol.kv_events import BlocksStored, KVCacheEvent, StoredBlock
from dynamo.router import _cost_fallback as py
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
    return pytest.importorskip("dynamo.router._cost")


def columns(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.choice([0, 0, rng.randrange(200)]) for _ in range(n)] for _ in range(5)]


@pytest.mark.parametrize("params", PARAMS)
def test_costs_and_choices_match_the_fallback(native: ModuleType, params: tuple) -> None:
    rng = random.Random(hash(params) & 0xFFFF)
    for n in (1, 2, 4, 17, 100):
        for _ in range(20):
            cols = columns(rng, n)
            isl, bs = rng.randrange(0, 3000), rng.choice([1, 16, 64])
            want = py.costs(*cols, isl, bs, params)
            got = native.costs(*cols, isl, bs, params)
            assert [c.hex() for c in got] == [c.hex() for c in want]  # bit for bit
            a, b = random.Random(n), random.Random(n)
            assert native.argmin_random_tie(got, a) == py.argmin_random_tie(want, b)
            assert a.getstate() == b.getstate()  # the same draws


def test_ties_draw_as_the_python_loop_does(native: ModuleType) -> None:
    values = [5.0, 5.0, 3.0, 3.0, 3.0, 9.0, 3.0]
    for seed in range(20):
        a, b = random.Random(seed), random.Random(seed)
        assert native.argmin_random_tie(values, a) == py.argmin_random_tie(values, b)
        assert a.getstate() == b.getstate()
    assert native.argmin_random_tie([], random.Random(0)) == 0


class _Shadowed(random.Random):
    """A generator whose randrange is its own: the tie loop must call it, not getrandbits."""

    def randrange(self, *args: object, **kwargs: object) -> int:  # type: ignore[override]
        self.calls += 1
        return 0

    calls = 0


def test_many_ties_draw_as_randrange_does(native: ModuleType) -> None:
    """Every candidate tied (100 idle workers): the native loop's getrandbits draws give the
    index and generator state of ``randrange``'s, for plain generators only."""
    for n in (2, 3, 100, 257):
        for seed in range(5):
            a, b = random.Random(seed), random.Random(seed)
            assert native.argmin_random_tie([1.0] * n, a) == py.argmin_random_tie([1.0] * n, b)
            assert a.getstate() == b.getstate()
    sub = _Shadowed(1)
    assert native.argmin_random_tie([1.0] * 5, sub) == 4  # randrange -> 0: the last tie wins
    assert sub.calls == 4
    plain = random.Random(1)
    plain.randrange = lambda k: 0  # type: ignore[method-assign]  # an instance override
    assert native.argmin_random_tie([1.0] * 5, plain) == 4


def test_ties_read_from_the_generator_state_draw_as_randrange_does(native: ModuleType) -> None:
    """The state path (CPython's layout, checked at import) is taken here, and its draws,
    interleaved with the generator's own calls and across regenerations of the state (624
    words), leave the index and the state of ``randrange``'s loop."""
    assert native.STATE_DRAWS is True
    for seed in range(3):
        a, b = random.Random(seed), random.Random(seed)
        for n in (2, 7, 100, 1000, 70_000):
            assert native.argmin_random_tie([1.0] * n, a) == py.argmin_random_tie([1.0] * n, b)
            assert a.random() == b.random()  # the generator's own draws in between
            assert a.getstate() == b.getstate()


@pytest.mark.parametrize("module", ["native", "fallback"])
def test_bad_input_is_refused(native: ModuleType, module: str) -> None:
    impl = native if module == "native" else py
    with pytest.raises(ValueError, match="block_size"):
        impl.costs([0], [0], [0], [0], [0], 16, 0, PARAMS[0])
    with pytest.raises(ValueError, match="one item per candidate"):
        impl.costs([0, 1], [0], [0], [0], [0], 16, 16, PARAMS[0])


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"overlap_score_credit_decay": 1.5, "decode_active_request_weight": 0.25},
        {"track_prefill_tokens": False},
        {"track_active_blocks": False},
        {"assume_kv_reuse": False},
        {"temperature": 0.7},
    ],
)
def test_column_path_chooses_as_the_candidate_path(settings: dict[str, object]) -> None:
    """Two cores fed the same requests: one routes (the column path), the other scores the
    same state through ``Candidate`` objects and ``select_worker``; every choice agrees."""
    kv = KVRouterSettings(**settings)  # type: ignore[arg-type]
    core = RoutingCore(4, kv, rng=random.Random(3))
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
        overlaps = core.find_matches(local)
        options = core._candidates(core._targets, seqs, overlaps)  # noqa: SLF001
        want = select_worker(options, len(tokens), 4, core.selector, twin_rng)
        got = core.route(f"r{i}", local, len(tokens), seq_hashes=seqs, overlaps=overlaps)
        assert got == want
        hits += got.overlap_blocks > 0
        if i % 3 == 0:
            core.prefill_completed(f"r{i // 2}")
        if i % 4 == 0:
            core.free(f"r{i // 3}")
    assert core.rng.getstate() == twin_rng.getstate()
    assert hits > 5

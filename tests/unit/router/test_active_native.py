"""router/_active.c against its fallback (``_active_fallback.py``): a request's load into and out
of ``ActiveSequences`` on random adds (prefix keys given or not, KV reuse or not, duplicates),
prefill completions, frees and expiry: the same results and the same tracker state."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from dynamo.router import _active_fallback as py
from dynamo.router.block_counts import prefix_key_bytes
from dynamo.router.sequences import ActiveSequences


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.router._active")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def snapshot(seqs: ActiveSequences) -> object:
    requests = [
        (rid, (r.rank.worker_id, r.rank.dp_rank), r.keys, r.private_blocks, r.prefill_tokens)
        for rid, r in seqs._requests.items()  # noqa: SLF001
    ]
    stale = sorted(seqs._stale)  # noqa: SLF001
    return seqs.active_loads(), requests, stale, seqs._next_check  # noqa: SLF001


@pytest.mark.parametrize("reuse", [True, False])
def test_native_and_fallback_keep_the_same_state(native: ModuleType, reuse: bool) -> None:
    clock = Clock()
    sides = []
    for module in (native, py):
        seqs = ActiveSequences(
            4, assume_kv_reuse=reuse, expiry_s=50.0, expiry_check_interval_s=5.0, clock=clock
        )
        seqs.add_worker(1, (0, 1))
        seqs.add_worker(2)
        sides.append((module, seqs))
    rng = random.Random(23)
    live: list[str] = []
    for step in range(1500):
        clock.now += rng.random()
        r = rng.random()
        if r < 0.55:
            rid = rng.choice(live) if live and rng.random() < 0.05 else f"r{step}"
            hashes = [rng.randrange(6) for _ in range(rng.randrange(0, 6))]
            isl, overlap = rng.randrange(0, 40), rng.randrange(0, 8)
            given = rng.random() < 0.7
            got, pick = [], rng.randrange(3)
            for module, seqs in sides:
                rank = seqs.rank_loads([], [(1, 0), (1, 1), (2, 0)])[0][pick]
                keys = prefix_key_bytes(hashes) if given and reuse else None
                got.append(module.add_routed(seqs, rid, rank, hashes, isl, overlap, keys))
            assert got[0] == got[1], step
            if got[0]:
                live.append(rid)
        elif r < 0.75 and live:
            rid = rng.choice(live)
            got = [module.mark_prefill_completed(seqs, rid) for module, seqs in sides]
            assert got[0] == got[1]
        else:
            rid = live.pop(rng.randrange(len(live))) if live and r < 0.97 else "unknown"
            got = [module.free(seqs, rid) for module, seqs in sides]
            assert got[0] == got[1] == (rid != "unknown")
        live = [rid for rid in live if rid in sides[1][1]]  # expired ones are gone
        assert snapshot(sides[0][1]) == snapshot(sides[1][1]), step
    for _, seqs in sides:
        seqs.check_invariants()
    assert not [module.mark_prefill_completed(seqs, "unknown") for module, seqs in sides][0]


@pytest.mark.parametrize("which", ["native", "fallback"])
def test_errors_propagate(native: ModuleType, which: str) -> None:
    module = native if which == "native" else py
    seqs = ActiveSequences(4, clock=lambda: 0.0)
    seqs.add_worker(1)
    rank = seqs.rank_loads([], [(1, 0)])[0][0]
    with pytest.raises(TypeError):
        module.add_routed(seqs, "a", rank, [1], 8, 0, "not bytes")
    assert module.add_routed(seqs, "a", rank, [1], 8, 0, None)  # keys from the hashes
    load = seqs.active_loads()[0]
    assert (load.active_prefill_tokens, load.active_decode_blocks, load.active_requests) == (
        8,
        1,
        1,
    )
    assert not module.add_routed(seqs, "a", rank, [1], 8, 0, None)
    with pytest.raises(TypeError):
        module.free(seqs)  # type: ignore[call-arg]

"""engine_core/_kv.c (a native table indexed by slot) against its fallback (``_kv_fallback.py``,
Python containers): random sequences of the scheduler's operations (admit with a cached
prefix, grow, promote filled blocks, release, evict) give the same return values, the same KV
events in the same order, and the same state (slots, refcounts, LRU order as seen through
eviction). Each side runs beside a twin that records its events in the raw form
(``record_raw_events``): the same results, and a buffer that is exactly ``kv_raw.encode`` of the
events. The native module is skipped where it is not built; test_kv_manager.py runs the
manager in use against a brute-force model."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest

from dynamo.engine_core import _kv_fallback as py
from dynamo.protocol import kv_raw

CHAIN = 8


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.engine_core._kv")


def block_hash(group: int, variant: int, i: int) -> int:
    """Chains of 4 groups share their first 3 blocks per group, then diverge by variant; one
    group uses negative hashes, one full 64-bit ones."""
    v = variant if i >= 3 else 0
    h = (group * 1000 + v * 100 + i) * 7919 + 1
    if group == 2:
        return -h
    if group == 3:
        return (1 << 64) - h
    return h


@dataclass
class Seq:
    chain: list[int]
    full: list[int] = field(default_factory=list)
    unique: list[int] = field(default_factory=list)


class WithRaw:
    """A manager and its twin recording raw events: every change goes to both, with the same
    result or exception (queries go to the first); ``drain_events`` checks the twin's buffer
    against the events."""

    BOTH = frozenset({"use", "allocate_unique", "promote_run", "release", "check_invariants"})

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        self.plain, self.raw = cls(*args, **kwargs), cls(*args, **kwargs)
        self.raw.record_raw_events()
        assert self.raw.raw_events and not self.plain.raw_events
        for name in ("refcount", "is_cached", "slot_of", "local_hash_of", "block_table"):
            setattr(self, name, getattr(self.plain, name))  # the queries: no __getattr__

    def __getattr__(self, name: str) -> Any:
        want = getattr(self.plain, name)
        if name not in self.BOTH:
            return want
        twin = getattr(self.raw, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = want(*args, **kwargs)
            except Exception as exc:
                with pytest.raises(type(exc)):
                    twin(*args, **kwargs)
                raise
            return same(twin(*args, **kwargs), result, name)

        return call

    def drain_events(self) -> Any:
        events = self.plain.drain_events()
        raw = self.raw.drain_raw_events()
        assert raw == kv_raw.encode(events) and kv_raw.decode(raw) == events
        return events


def same(a: Any, b: Any, what: str) -> Any:
    assert a == b, what
    return a


def outcome(call: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return ("ok", call(*args, **kwargs))
    except (KeyError, RuntimeError, ValueError) as exc:
        return ("error", type(exc).__name__)


def compare_state(a: Any, b: Any, hashes: list[int]) -> None:
    a.check_invariants()
    b.check_invariants()
    same(a.drain_events(), b.drain_events(), "events")
    for name in ("num_active_blocks", "num_inactive_blocks", "num_available_blocks"):
        same(getattr(a, name), getattr(b, name), name)
    same(a.cached_blocks(), b.cached_blocks(), "cached blocks")
    for h in hashes:
        same(a.refcount(h), b.refcount(h), "refcount")
        same(a.is_cached(h), b.is_cached(h), "is_cached")
        if b.is_cached(h):
            same(a.slot_of(h), b.slot_of(h), "slot")
            same(a.local_hash_of(h), b.local_hash_of(h), "local hash")


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("caching", [True, False])
def test_random_operations_match_the_fallback(native: ModuleType, seed: int, caching: bool) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([6, 12, 24])
    a = WithRaw(native.KVManager, capacity, dp_rank=seed, enable_prefix_caching=caching)
    b = WithRaw(py.KVManager, capacity, dp_rank=seed, enable_prefix_caching=caching)
    same(a.num_blocks, b.num_blocks, "num_blocks")
    same(a.dp_rank, b.dp_rank, "dp_rank")
    chains = [[block_hash(g, v, i) for i in range(CHAIN)] for g in range(4) for v in range(3)]
    every = sorted({h for c in chains for h in c})
    running: list[Seq] = []
    for step in range(250):
        op = rng.random()
        if op < 0.35:  # admit: cached prefix, full blocks at admission, private blocks
            seq = Seq(rng.choice(chains)[: rng.randrange(1, CHAIN + 1)])
            hit = same(a.num_cached_prefix(seq.chain), b.num_cached_prefix(seq.chain), "hit")
            n_full = min(len(seq.chain), hit + rng.randrange(3)) if caching else 0
            n_unique = rng.randrange(0, 3)
            full = seq.chain[:n_full]
            local = [h ^ 0x5555 for h in full]
            need = same(
                a.num_slots_needed(full, n_unique), b.num_slots_needed(full, n_unique), "need"
            )
            announce = rng.random() < 0.8
            if full:
                r = same(
                    outcome(a.use, full, local, announce=announce),
                    outcome(b.use, full, local, announce=announce),
                    f"use {step}",
                )
                if r[0] == "error":
                    assert need > b.num_available_blocks or r[1] == "RuntimeError"
                    continue
                seq.full = list(full)
            ids = same(a.allocate_unique(n_unique), b.allocate_unique(n_unique), "allocate")
            if ids is None:
                a.release(seq.full, [])
                b.release(seq.full, [])
                continue
            seq.unique = ids
            running.append(seq)
        elif op < 0.5 and running:  # grow a tail
            seq = rng.choice(running)
            n = rng.randrange(1, 3)
            ids = same(a.allocate_unique(n), b.allocate_unique(n), "grow")
            if ids is not None:
                seq.unique.extend(ids)
        elif op < 0.7 and running and caching:  # private blocks filled up: promote them
            seq = rng.choice(running)
            k = len(seq.full)
            n = min(len(seq.unique), len(seq.chain) - k, rng.randrange(1, 4))
            if n <= 0:
                continue
            hashes = seq.chain[k : k + n]
            local = [h ^ 0x5555 for h in hashes]
            parent = seq.chain[k - 1] if k else None
            a.promote_run(seq.unique[:n], hashes, local, parent)
            b.promote_run(seq.unique[:n], hashes, local, parent)
            del seq.unique[:n]
            seq.full.extend(hashes)
        elif op < 0.95 and running:  # finish or preempt
            seq = running.pop(rng.randrange(len(running)))
            a.release(seq.full, seq.unique)
            b.release(seq.full, seq.unique)
        else:  # refused: a private block that is not allocated; nothing changes
            bogus = [capacity + 5]
            same(outcome(a.release, [], bogus), outcome(b.release, [], bogus), "refused")
        compare_state(a, b, every)
        same(
            a.block_table([h for s in running for h in s.full], [1, 2]),
            b.block_table([h for s in running for h in s.full], [1, 2]),
            "block table",
        )
    for seq in running:  # everything released: every block inactive or free
        a.release(seq.full, seq.unique)
        b.release(seq.full, seq.unique)
    compare_state(a, b, every)
    assert a.num_active_blocks == 0


def test_bad_input_is_refused(native: ModuleType) -> None:
    kv = native.KVManager(4)
    with pytest.raises(ValueError):
        native.KVManager(0)
    with pytest.raises(TypeError):
        kv.use(["x"], [1])
    with pytest.raises(OverflowError):
        kv.use([1 << 64], [1])
    with pytest.raises(IndexError):
        kv.use([1, 2], [1])
    with pytest.raises(RuntimeError, match="not enough"):
        kv.use([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    with pytest.raises(KeyError):
        kv.slot_of(99)
    with pytest.raises(KeyError):
        kv.release([99], [])
    with pytest.raises(KeyError):
        kv.promote_run([3], [7], [7], None)  # 3 is not a private block
    with pytest.raises(ValueError):
        kv.allocate_unique(-1)
    assert kv.refcount("x") == 0 and not kv.is_cached(1 << 70)  # absent, not an error
    assert kv.num_cached_prefix([1 << 70]) == 0
    assert kv.drain_events() == [] and kv.num_active_blocks == 0
    kv.check_invariants()
    off = native.KVManager(4, enable_prefix_caching=False)
    with pytest.raises(RuntimeError, match="prefix caching"):
        off.use([1], [1])


@pytest.mark.parametrize("impl", ["native", "fallback"])
def test_raw_events_are_refused_where_they_do_not_apply(native: ModuleType, impl: str) -> None:
    cls = native.KVManager if impl == "native" else py.KVManager
    kv = cls(4)
    with pytest.raises(RuntimeError, match="does not record raw"):
        kv.drain_raw_events()
    kv.use([1, 2], [11, 12])
    with pytest.raises(RuntimeError, match="pending"):
        kv.record_raw_events()  # the structs of the use above are not drained
    assert len(kv.drain_events()) == 1
    kv.record_raw_events()
    with pytest.raises(RuntimeError, match="records raw"):
        kv.drain_events()
    assert kv.drain_raw_events() == b""
    kv.release([1, 2], [])
    kv.use([1, 2, 3], [11, 12, 13])
    assert kv_raw.decode(kv.drain_raw_events())[0].event_id == 1  # the numbering goes on
    with pytest.raises(ValueError, match="dp_rank"):
        cls(4, dp_rank=-1).record_raw_events()

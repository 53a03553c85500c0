"""engine_core/_kv.c against its fallback (``_kv_fallback.py``): the same walks over twin
containers leave the same containers (order included: the inactive pool is an LRU) and return
the same values. The native module is skipped where it is not built; test_kv_manager.py runs
the KV manager on whichever is in use."""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from types import ModuleType
from typing import Any

import pytest

from dynamo.engine_core import _kv_fallback as py


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.engine_core._kv")


def pools(rng: random.Random) -> dict[str, Any]:
    """Containers in the shape KVManager keeps them: 40 cached blocks, some active."""
    hashes = rng.sample(range(1, 1 << 62), 40)
    active = {h: rng.randrange(1, 4) for h in hashes[:20]}
    inactive: OrderedDict[int, None] = OrderedDict((h, None) for h in hashes[20:])
    slots = {h: i for i, h in enumerate(hashes)}
    return {
        "hashes": hashes,
        "active": active,
        "inactive": inactive,
        "slots": slots,
        "locals_": {h: h ^ 0xABC for h in hashes},
        "silent": set(rng.sample(hashes[20:], 5)),
        "free_slots": [40, 41],
    }


def state(p: dict[str, Any]) -> tuple[Any, ...]:
    keys = ("active", "slots", "locals_", "silent", "free_slots")
    return (list(p["inactive"]), *(copy.copy(p[k]) for k in keys))


def twins(seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return pools(random.Random(seed)), pools(random.Random(seed))


def test_queries_match(native: ModuleType) -> None:
    rng = random.Random(1)
    for seed in range(20):
        p = pools(random.Random(seed))
        for _ in range(10):
            q = rng.sample(p["hashes"], rng.randrange(0, 12)) + [rng.randrange(1 << 62)]
            rng.shuffle(q)
            args = (p["active"], p["inactive"], q)
            assert native.cached_prefix(*args) == py.cached_prefix(*args)
            assert native.count_missing(p["active"], q) == py.count_missing(p["active"], q)
        assert native.cached_prefix(p["active"], p["inactive"], p["hashes"]) == 40


def test_pin_leaves_the_same_state(native: ModuleType) -> None:
    for seed in range(20):
        a, b = twins(seed)
        rng = random.Random(seed)
        fresh = [rng.randrange(1 << 62) for _ in range(5)]
        chain = rng.sample(a["hashes"], 15) + fresh + fresh[:1]  # an absent hash twice
        rng.shuffle(chain)
        absent = [impl.pin(p["active"], p["inactive"], chain) for impl, p in ((py, a), (native, b))]
        assert absent[0] == absent[1] and len(absent[0]) == 6
        assert state(a) == state(b)


def test_release_and_evict_leave_the_same_state(native: ModuleType) -> None:
    for seed in range(20):
        a, b = twins(seed)
        rng = random.Random(seed)
        chain = rng.sample(list(a["active"]), 8)  # counts 1-3: some leave active, some stay
        for impl, p in ((py, a), (native, b)):
            impl.release_full(p["active"], p["inactive"], chain)
        assert state(a) == state(b)
        n = rng.randrange(0, len(a["inactive"]) + 1)
        evicted = [
            impl.evict(p["inactive"], p["slots"], p["locals_"], p["silent"], p["free_slots"], n)
            for impl, p in ((py, a), (native, b))
        ]
        assert evicted[0] == evicted[1]
        assert state(a) == state(b)


@pytest.mark.parametrize("impl", ["native", "fallback"])
def test_errors(native: ModuleType, impl: str) -> None:
    module = native if impl == "native" else py
    p = pools(random.Random(9))
    unknown = 12345
    with pytest.raises(KeyError):
        module.release_full(p["active"], p["inactive"], [unknown])
    empty: OrderedDict[int, None] = OrderedDict()
    with pytest.raises(KeyError):
        module.evict(empty, {}, {}, set(), [], 1)
    assert module.evict(empty, {}, {}, set(), [], 0) == []

"""router/_route_record.c against its fallback (``_route_record_fallback.py``) and against the
core's Python route (``RoutingCore._choose`` without a recorder): on random routes, records,
prefill completions, frees, duplicates, membership changes and other callers of the load
tables, the same selections (costs bit for bit), loads, requests and generator draws."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest

from dynamo.protocol.kv_events import BlocksStored, StoredBlock
from dynamo.router import _route_record_fallback as py
from dynamo.router import core as core_module
from dynamo.router._route import choose as native_choose
from dynamo.router.block_counts import new_blocks_of_keys
from dynamo.router.config import KVRouterSettings
from dynamo.router.core import RoutingCore, WorkerSpec
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.router.selector import Selection
from dynamo.router.sequences import add_routed


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.router._route_record")


def recorder_of(module: ModuleType | None) -> Any:
    """A ``_new_recorder`` building ``module``'s recorder (None: the core routes in Python)."""

    def build(core: RoutingCore, ranks: list[Any]) -> Any:
        if module is None:
            return None
        assert core.indexer is not None
        find, key_of = core.indexer.slot_finder()
        return module.RouteRecorder(
            find,
            key_of,
            core._target_index,  # noqa: SLF001
            core._target_keys,  # noqa: SLF001
            ranks,
            [rank.blocks for rank in ranks],
            core.sequences.resolved,
            core.sequences,
            add_routed,
            new_blocks_of_keys,
            core_module._choose,  # noqa: SLF001
            Selection,
            core._cost_params,  # noqa: SLF001
            core.rng,
            core.settings.track_active_blocks,
            core.block_size,
        )

    return build


def state(core: RoutingCore) -> object:
    seqs = core.sequences
    return (seqs.active_loads(), seqs.request_ids(), core.rng.getstate())


@pytest.mark.parametrize(
    "settings", [{}, {"track_active_blocks": False}, {"overlap_score_credit_decay": 0.5}]
)
def test_recorders_route_and_record_as_the_python_route(
    native: ModuleType, settings: dict[str, object]
) -> None:
    kv = KVRouterSettings(**settings)  # type: ignore[arg-type]
    cores = []
    for module in (native, py, None):
        core = RoutingCore(4, kv, rng=random.Random(3), clock=lambda: 0.0)
        core._new_recorder = recorder_of(module).__get__(core)  # type: ignore[method-assign]  # noqa: SLF001
        cores.append(core)
    rng = random.Random(17)
    prefixes = [[rng.randrange(500) for _ in range(32)] for _ in range(4)]
    live: list[str] = []
    workers = 3
    for core in cores:
        for wid in range(workers):
            core.add_worker(WorkerSpec(100 + wid, 0, 2 if wid == 1 else 1))
    for step in range(600):
        r = rng.random()
        if r < 0.05:  # a stored prefix on some rank
            prefix = rng.choice(prefixes)[: rng.randrange(4, 33)]
            local = local_block_hashes(prefix, 4)
            blocks = [StoredBlock(s, h) for s, h in zip(sequence_hashes(local), local, strict=True)]
            wid = 100 + rng.randrange(workers)
            for core in cores:
                assert core.indexer is not None
                core.indexer.apply_data(wid, 0, BlocksStored(parent_hash=None, blocks=blocks))
        elif r < 0.07:  # a worker joins or leaves (the recorder is rebuilt)
            wid = 100 + rng.randrange(workers + 1)
            for core in cores:
                if wid in core.workers and len(core.workers) > 1:
                    core.remove_worker(wid)
                else:
                    core.add_worker(WorkerSpec(wid))
            workers = max(workers, wid - 99)
        elif r < 0.09:  # another reader of the load tables (the recorder stands aside)
            for core in cores:
                core.sequences.load_columns([1, 2], core.sequences.ranks()[::-1])
        elif r < 0.25 and live:
            rid = live.pop(rng.randrange(len(live)))
            got = [(core.prefill_completed(rid), core.free(rid)) for core in cores]
            assert got[0] == got[1] == got[2], step
        else:
            tokens = rng.choice(prefixes)[: rng.randrange(0, 33)]
            tokens += [rng.randrange(500) for _ in range(rng.randrange(0, 9))]
            local = local_block_hashes(tokens, 4)
            rid = rng.choice(live) if live and rng.random() < 0.05 else f"r{step}"  # a duplicate
            record = rng.random() < 0.9
            got = []
            for core in cores:
                chosen = core.route(rid, local, len(tokens), record=record)
                got.append((chosen.key, chosen.overlap_blocks, chosen.cached_tokens))
                got.append([c.hex() for c in chosen.scores])
                got.append(state(core))
            assert got[0:3] == got[3:6] == got[6:9], step
            if record and rid not in live:
                live.append(rid)
    assert cores[0]._recorder is not None  # noqa: SLF001  (it served)


@pytest.mark.parametrize("which", ["native", "fallback"])
def test_refusals(native: ModuleType, which: str) -> None:
    module = native if which == "native" else py
    core = RoutingCore(4, KVRouterSettings(), rng=random.Random(1), clock=lambda: 0.0)
    core.add_worker(WorkerSpec(1))
    core.route("a", [1, 2], 8)  # resolves the ranks
    rec = recorder_of(module)(core, core.sequences.rank_loads([], core._target_keys)[0])  # noqa: SLF001
    keys = core.prefix_keys(sequence_hashes([1, 2]))
    assert keys is not None
    assert rec.route("b", [1, 2], sequence_hashes([1, 2]), 8.0, keys, True) is None  # not an int
    chosen = rec.route("b", [], [], 8, b"", True)
    assert chosen.key == (1, 0) and core.sequences.request_ids() == ["a", "b"]
    assert rec.route("b", [], [], 8, b"", True).key == (1, 0)  # a duplicate records once
    assert core.sequences.request_ids() == ["a", "b"]
    core.add_worker(WorkerSpec(2))  # the ranks change: it stands aside, nothing drawn
    state0 = core.rng.getstate()
    assert rec.route("c", [], [], 8, b"", True) is None and core.rng.getstate() == state0
    with pytest.raises(ValueError, match="one each per target"):
        module.RouteRecorder(
            print, [], {}, [], [], [], None, core.sequences, add_routed, print, native_choose,
            Selection, (1.0, 1.0, 0.0, 0.0, True), random.Random(), True, 4,
        )  # fmt: skip
    with pytest.raises(TypeError):
        module.RouteRecorder(*([None] * 16))

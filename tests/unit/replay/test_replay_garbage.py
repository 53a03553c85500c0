"""A replay runs with the cyclic collector paused (``Simulation.run``), which is safe because it
makes no cyclic garbage: reference counting frees everything a run drops, whatever the replay's
kind, so the memory of a long run is bounded without the collector. What the result keeps is
freed by reference counting too once the result is dropped (only the deployment's own objects,
a fixed number, wait for the collector). The caller's collector setting is back afterwards."""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamo.bench.benchmark import build_workload
from dynamo.bench.config import BenchConfig
from dynamo.bench.workload import Session
from dynamo.frontend.disagg import DisaggSettings
from dynamo.mocker.config import MockerConfig
from dynamo.replay import simulator
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import prompt_builder, run_replay
from dynamo.replay.simulator import Simulation
from dynamo.router import radix_tree
from dynamo.router.config import KVRouterSettings
from tests.unit.replay.simulations import simulation

ENGINE = MockerConfig(num_gpu_blocks=256, block_size=16)
PER_REQUEST = {"Flight", "RequestRecord", "RequestSpec", "RoutingRecord", "Runner"}
"""What a request leaves behind: none of it may be cyclic garbage."""


def _bench(n: int, **overrides: Any) -> BenchConfig:
    values: dict[str, Any] = {
        "url": "replay:",
        "workload": "prefix",
        "prefix_groups": 4,
        "prefix_len": 128,
        "suffix_len": 32,
        "osl": 8,
        "concurrency": 8,
        "num_requests": n,
        "isl": 96,
    }
    values.update(overrides)
    return BenchConfig(**values)


def _trace(path: Path, n: int) -> str:
    lines = [
        {
            "timestamp": 30 * i,
            "input_length": 64 + 16 * (i % 3),
            "output_length": 3 + i % 4,
            "hash_ids": [1 + i % 2, 10 + i % 5, 100 + i],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


QUEUE = KVRouterSettings(queue_threshold=0.5, queue_max_requests=4)
KINDS: dict[str, tuple[dict[str, Any], Deployment]] = {
    "prefix": ({}, Deployment(4, "kv", engine=ENGINE)),
    "multi-turn, think time": (
        {"workload": "multi-turn", "turns": 3, "think_time_s": 0.05},
        Deployment(2, "kv", engine=ENGINE),
    ),
    "trace": ({"workload": "trace", "trace_block_size": 32}, Deployment(2, "kv", engine=ENGINE)),
    "round-robin": ({}, Deployment(3, "round-robin", engine=ENGINE)),
    "disaggregated 2P2D": (
        {},
        Deployment(
            2,
            "kv",
            engine=ENGINE,
            prefill_workers=2,
            disagg=DisaggSettings(max_local_prefill_length=64),
        ),
    ),
    "DP ranks": (
        {},
        Deployment(2, "kv", engine=MockerConfig(num_gpu_blocks=256, data_parallel_size=2)),
    ),
    "router queue": (
        {"rate": 300.0, "prefix_len": 1024},
        Deployment(2, "kv", kv=QUEUE, engine=ENGINE),
    ),
    "timeouts": (
        {"rate": 200.0, "max_concurrency": 6, "request_timeout_s": 1.0, "osl": 48},
        Deployment(1, "kv", engine=ENGINE),
    ),
    "warm-up": ({"warmup": 12}, Deployment(2, "kv", engine=ENGINE)),
    "frontend time": ({}, Deployment(2, "kv", engine=ENGINE, frontend_ms=0.5)),
}


def _cyclic_garbage(bench: BenchConfig, deployment: Deployment, *, keep: bool) -> list[object]:
    """The objects ``gc.collect()`` finds unreachable after a replay, the result kept or
    dropped. What the process held before is frozen meanwhile (it is no part of the answer,
    and traversing a test process's heap takes the time)."""
    gc.disable()
    gc.freeze()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        result = run_replay(bench, deployment, plots=False)
        assert len(result.records) == bench.num_requests
        assert any(r.ok for r in result.records)
        if not keep:
            del result
        gc.collect()
        return _ours(list(gc.garbage))
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.unfreeze()
        gc.enable()


def _ours(garbage: list[object]) -> list[object]:
    """What of ``garbage`` the replay could have made: all of it when this is the process's only
    thread; else (a thread an earlier test left running may make garbage of its own meanwhile)
    the objects of dynamo's types and the containers that hold one."""
    if threading.active_count() == 1:
        return garbage

    def dynamo(obj: object) -> bool:
        return type(obj).__module__.startswith("dynamo.")

    return [o for o in garbage if dynamo(o) or any(map(dynamo, gc.get_referents(o)))]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_replay_leaves_no_cyclic_garbage(kind: str, tmp_path: Path) -> None:
    overrides, deployment = KINDS[kind]
    counts = []
    for n in (24, 48):
        extra = dict(overrides)
        if extra.get("workload") == "trace":
            extra["trace"] = _trace(tmp_path / f"trace{n}.jsonl", n)
        bench = _bench(n, **extra)
        # the result kept: the run itself left nothing for the collector
        assert _cyclic_garbage(bench, deployment, keep=True) == []
        # dropped: its requests go by reference counting; the deployment's objects remain
        dropped = _cyclic_garbage(bench, deployment, keep=False)
        assert not PER_REQUEST & {type(o).__name__ for o in dropped}
        counts.append(len(dropped))
    if radix_tree.IMPLEMENTATION == "dynamo.router._radix":
        # (the twin's prefix tree is Python nodes with parent links: state that grows with the
        # distinct prompts the workers hold, not with the requests)
        assert counts[0] == counts[1]


def _simulation(sessions: Iterator[Session]) -> Simulation:
    return simulation(_bench(16), Deployment(2, "kv", engine=ENGINE), sessions)


def _sessions(enabled: list[bool], *, fail_after: int | None = None) -> Iterator[Session]:
    """The prefix workload's sessions, noting whether the collector ran as each is drawn."""
    _, builder = prompt_builder(None)
    for i, session in enumerate(build_workload(_bench(16), builder).sessions()):
        enabled.append(gc.isenabled())
        if fail_after is not None and i == fail_after:
            raise RuntimeError("the workload failed")
        yield session


@pytest.mark.parametrize("caller_enabled", [True, False])
def test_the_collector_is_paused_during_the_run_and_restored(caller_enabled: bool) -> None:
    seen: list[bool] = []
    sim = _simulation(_sessions(seen))
    if not caller_enabled:
        gc.disable()
    try:
        result = sim.run()
        assert gc.isenabled() is caller_enabled
    finally:
        gc.enable()
    assert len(result.flights) == 16
    assert seen and not any(seen)
    assert sim.flights == []  # handed to the result: no reference cycle through them


def test_the_collector_is_restored_when_the_run_raises() -> None:
    seen: list[bool] = []
    sim = _simulation(_sessions(seen, fail_after=3))
    with pytest.raises(RuntimeError, match="the workload failed"):
        sim.run()
    assert gc.isenabled()
    assert seen and not any(seen)


def test_the_records_are_left_out_of_the_collectors_traversals() -> None:
    """What a run keeps a request and the collector would traverse once it resumes: the record
    is never tracked (a ``gc=False`` Struct), and the C loop untracks a finished request's ITL
    list (floats only); the flight itself stays tracked."""
    result = run_replay(_bench(16), Deployment(2, "kv", engine=ENGINE), plots=False)
    records = [f.record for f in result.flights]
    assert records and all(r.ok and len(r.itl) == 7 for r in records)
    assert not any(gc.is_tracked(r) for r in records)
    assert all(gc.is_tracked(f) for f in result.flights)
    if simulator._native_loop is not None:
        assert not any(gc.is_tracked(r.itl) for r in records)

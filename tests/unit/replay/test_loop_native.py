"""replay/_loop.c (the event loop, ``_pass_start`` and ``_pass_end`` in C) against the Python
loop it follows (``Simulation._phase``): the same records, routing, simulated time, event and
pass counts on random deployments of every kind the loop branches on (kv / round-robin, DP
ranks, xPyD, the router queue, request timeouts, a warm-up, speedup 0), errors raised by a
callback come out of ``run`` unchanged, and nothing it touched is left referenced."""

from __future__ import annotations

import random
import sys
from types import ModuleType
from typing import Any

import msgspec
import pytest

from dynamo.bench.config import BenchConfig
from dynamo.engine_core.scheduler import Scheduler
from dynamo.frontend.disagg import DisaggSettings
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.timing import TimingModel
from dynamo.replay import pools, simulator
from dynamo.replay.deployment import Deployment
from dynamo.replay.load import LoadGenerator
from dynamo.replay.report import routing_rows
from dynamo.replay.run import run_replay
from dynamo.router.config import KVRouterSettings
from dynamo.router.core import RoutingCore
from dynamo.router.hashing import SharedPrefixHasher
from tests.unit.replay.simulations import simulation


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.replay._loop")


def _random_case(seed: int) -> tuple[BenchConfig, Deployment]:
    rng = random.Random(seed)
    engine = MockerConfig(
        num_gpu_blocks=rng.choice([96, 256, 512]),
        block_size=rng.choice([16, 32]),
        speedup_ratio=rng.choice([1.0, 1.0, 4.0, 0.0]),
        data_parallel_size=rng.choice([1, 1, 2]),
        max_num_batched_tokens=rng.choice([512, 2048, 8192]),
    )
    bench: dict[str, Any] = {
        "url": "replay:",
        "workload": "prefix",
        "prefix_groups": rng.choice([2, 4, 8]),
        "prefix_len": rng.choice([64, 256, 700]),
        "suffix_len": rng.choice([16, 64]),
        "osl": rng.choice([4, 16, 40]),
        "num_requests": rng.choice([40, 80]),
        "seed": seed,
    }
    if rng.random() < 0.4:
        bench["rate"] = rng.choice([50.0, 300.0])
        bench["max_concurrency"] = rng.choice([None, 6])
    else:
        bench["concurrency"] = rng.choice([4, 16])
    if seed % 3 == 0:
        bench["request_timeout_s"] = rng.choice([0.4, 0.8, 1.5])
    if rng.random() < 0.2:
        bench["warmup"] = 10
        bench["isl"] = 200
    kind = ("kv", "round-robin", "disagg", "queue")[seed % 4]
    if kind == "disagg":
        deployment = Deployment(
            2,
            "kv",
            engine=engine,
            prefill_workers=rng.choice([1, 3]),
            disagg=DisaggSettings(max_local_prefill_length=rng.choice([32, 300])),
        )
    elif kind == "queue":  # an open loop past the workers' capacity: requests wait, some fail
        bench.update(rate=300.0, prefix_len=1500, max_concurrency=None)
        kv = KVRouterSettings(
            queue_threshold=0.3, queue_policy=rng.choice(["fcfs", "wspt"]), queue_max_requests=5
        )
        deployment = Deployment(3, "kv", kv=kv, engine=engine)
    else:
        deployment = Deployment(rng.choice([1, 3, 5]), kind, engine=engine)
    return BenchConfig(**bench), deployment


def _outcome(bench: BenchConfig, deployment: Deployment) -> tuple[Any, ...]:
    result = run_replay(bench, deployment, plots=False)
    sim = result.simulation
    return (
        [msgspec.json.encode(r) for r in result.records],
        [msgspec.json.encode(row) for row in routing_rows(result.flights)],
        sim.simulated_s,
        sim.events,
        sim.passes,
        sim.per_rank_passes,
        sim.warmup_s,
    )


def test_constants_are_the_simulators(native: ModuleType) -> None:
    kinds = (simulator._SEND, simulator._PASS_END, simulator._PASS_START)
    assert (native.SEND, native.PASS_END, native.PASS_START) == kinds
    assert (native.IDLE, native.SCHEDULED, native.BUSY) == (
        pools.IDLE,
        pools.SCHEDULED,
        pools.BUSY,
    )


@pytest.mark.parametrize("seed", range(16))
def test_same_outcome_as_the_python_loop(
    native: ModuleType, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench, deployment = _random_case(seed)
    monkeypatch.setattr(simulator, "_native_loop", native)
    fast = _outcome(bench, deployment)
    monkeypatch.setattr(simulator, "_native_loop", None)
    assert _outcome(bench, deployment) == fast
    assert fast[3] > 0


def test_same_outcome_with_decoded_text(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-turn workload decodes each answer's text: its finished requests are retired by
    ``Simulation._retire`` from the C loop too, with the same outcome."""
    bench = BenchConfig(
        url="replay:",
        workload="multi-turn",
        turns=3,
        isl=40,
        osl=6,
        concurrency=4,
        num_requests=24,
        seed=5,
    )
    deployment = Deployment(2, "kv", engine=MockerConfig(num_gpu_blocks=64, block_size=16))
    monkeypatch.setattr(simulator, "_native_loop", native)
    fast = _outcome(bench, deployment)
    monkeypatch.setattr(simulator, "_native_loop", None)
    assert _outcome(bench, deployment) == fast


def test_same_outcome_when_workers_refuse_requests(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of random lengths, some beyond one rank's KV pool: the engine refuses those at
    the send (``new_sequence``'s ``InvalidArgument``, the request failed with ``http_400``),
    in the C send as in ``Simulation._route``, the others run; and with a timeout."""
    deployment = Deployment(2, "kv", engine=MockerConfig(num_gpu_blocks=12, block_size=16))
    for timeout in ({}, {"request_timeout_s": 0.5}):
        bench = BenchConfig(
            url="replay:",
            isl=150,
            isl_stddev=60.0,
            osl=8,
            concurrency=6,
            num_requests=60,
            seed=7,
            **timeout,
        )
        monkeypatch.setattr(simulator, "_native_loop", native)
        fast = _outcome(bench, deployment)
        monkeypatch.setattr(simulator, "_native_loop", None)
        assert _outcome(bench, deployment) == fast
        errors = {msgspec.json.decode(r)["error"] for r in fast[0]}
        assert "http_400" in errors and None in errors


@pytest.mark.parametrize(
    ("seed", "owner", "name"),
    [
        (0, LoadGenerator, "ended"),  # a finished request retired in C: its runner goes on
        (0, RoutingCore, "free"),  # ... and the router frees it
        (2, simulator.Simulation, "_retire"),  # disaggregated: a prefill's end is Python's
        # the thin methods the loop runs the bodies of: a replaced one is called
        (0, Scheduler, "mock_pass"),
        (0, Scheduler, "has_work"),
        (0, RoutingCore, "apply_events"),
        (0, RoutingCore, "prefill_completed"),
        (0, Scheduler, "enqueue"),  # ... and the send's
        (0, SharedPrefixHasher, "hashes"),
    ],
)
def test_a_callbacks_error_comes_out(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch, seed: int, owner: type, name: str
) -> None:
    monkeypatch.setattr(simulator, "_native_loop", native)

    def broken(*args: Any) -> None:
        raise RuntimeError(f"{name} failed")

    monkeypatch.setattr(owner, name, property(broken) if name == "has_work" else broken)
    bench, deployment = _random_case(seed)
    with pytest.raises(RuntimeError, match=f"{name} failed"):
        run_replay(bench, deployment, plots=False)


def test_bad_arguments(native: ModuleType) -> None:
    with pytest.raises(TypeError):
        native.run(1, 2, 3)
    with pytest.raises(AttributeError):
        native.run(object(), [], [], iter([]), print, print)


def _refcounts_after_a_run(loop: ModuleType | None, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    monkeypatch.setattr(simulator, "_native_loop", loop)
    sim = simulation(*_random_case(1))
    flights = sim.run().flights
    ranks = list(sim.decode_pool.ranks.values())
    return [
        sys.getrefcount(sim),
        sys.getrefcount(sim.now),
        *(sys.getrefcount(r) for r in ranks),
        *(sys.getrefcount(f) for f in flights),
        *(sys.getrefcount(f.record) for f in flights),
    ]


def test_no_reference_left(native: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a run, the simulation, its ranks, its flights and records and the last instant are
    referenced exactly as after the Python loop's run (nothing kept or lost in C)."""
    fast = _refcounts_after_a_run(native, monkeypatch)
    assert fast == _refcounts_after_a_run(None, monkeypatch)


@pytest.mark.parametrize("seed", range(4))
def test_pass_timing_is_the_timing_models_bit_for_bit(native: ModuleType, seed: int) -> None:
    """The loop times a pass itself (no ``StepOutput``): the same float as
    ``TimingModel.pass_seconds`` for random batches, speedups (0 included) and pools."""
    rng = random.Random(seed)
    for _ in range(2000):
        timing = TimingModel(
            total_kv_tokens=rng.choice([0, 16, 8192, rng.randrange(1, 10**7)]),
            speedup_ratio=rng.choice([0.0, 1.0, 2.5, rng.random() * 10]),
            decode_speedup_ratio=rng.choice([1.0, 0.5, rng.random() * 4 + 0.01]),
        )
        prefill = rng.choice([0, 1, rng.randrange(1, 70_000)])
        context = rng.choice([0, rng.randrange(0, 10**7)])
        decodes = rng.choice([0, 1, rng.randrange(1, 1024)])
        want = timing.pass_seconds(prefill, context, decodes)
        got = native.pass_seconds(timing, prefill, context, decodes)
        assert type(got) is float and got.hex() == want.hex()

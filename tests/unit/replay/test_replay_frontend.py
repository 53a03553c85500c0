"""The replay's model of the frontend's own time a request (``Deployment.frontend_ms``): the
router sees sends one after another at that pace, in send order; TTFT counts it; a request
that times out before the frontend is done with it frees everything."""

from __future__ import annotations

import math

import pytest

from dynamo.bench.config import BenchConfig
from dynamo.mocker.config import MockerConfig
from dynamo.replay.__main__ import build_parser, deployment
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import run_replay
from tests.unit.replay.simulations import simulation

EXACT = 1e-6  # ms
PREFILL_1024_MS = 32.490712  # P(1024), FACTS §6.4 (tests/unit/replay/test_replay_timing.py)


def _bench(concurrency: int, requests: int, **overrides: object) -> BenchConfig:
    return BenchConfig(
        url="replay:",
        workload="synthetic",
        isl=1024,
        osl=4,
        concurrency=concurrency,
        num_requests=requests,
        **overrides,  # type: ignore[arg-type]
    )


def test_one_request_reaches_the_router_after_the_frontend_time() -> None:
    plain = run_replay(_bench(1, 1), Deployment(1, "round-robin"))
    modelled = run_replay(_bench(1, 1), Deployment(1, "round-robin", frontend_ms=10.0))
    (a,), (b,) = plain.records, modelled.records
    assert a.ttft is not None and b.ttft is not None
    assert a.ttft * 1000 == pytest.approx(PREFILL_1024_MS, abs=EXACT)
    assert b.ttft * 1000 == pytest.approx(PREFILL_1024_MS + 10.0, abs=EXACT)
    assert b.itl == a.itl  # the engine's pace is unchanged
    assert modelled.summary["server"]["deployment"]["frontend_ms"] == 10.0
    assert "frontend_ms" not in plain.summary["server"]["deployment"]


@pytest.mark.parametrize("router_mode", ["round-robin", "kv"])
def test_a_burst_is_spread_in_send_order(router_mode: str) -> None:
    """Four sends at once on four workers: the k-th reaches the router k frontend times in."""
    result = run_replay(_bench(4, 4), Deployment(4, router_mode, frontend_ms=7.0))
    ttfts = sorted(r.ttft * 1000 for r in result.records if r.ttft is not None)
    assert len(ttfts) == 4
    for k, ttft in enumerate(ttfts, start=1):
        assert ttft == pytest.approx(PREFILL_1024_MS + 7.0 * k, abs=EXACT)


def test_a_request_timing_out_at_the_frontend_frees_everything() -> None:
    """Eight sends at once, 80 ms each at the frontend, a 0.25 s timeout: two finish, the
    third times out in its engine and the rest before they reach the router, each at its
    deadline; nothing is left held."""
    bench = _bench(8, 8, request_timeout_s=0.25)
    engine = MockerConfig(num_gpu_blocks=512, block_size=16)
    sim = simulation(bench, Deployment(2, "kv", engine=engine, frontend_ms=80.0))
    flights = sim.run().flights
    records = [f.record for f in flights]
    assert sum(r.ok for r in records) == 2
    for r in records[2:]:
        assert r.error == "timeout" and r.e2e == pytest.approx(0.25)
        assert r.output_tokens == 0
    core = sim.decode_pool.core
    assert core is not None and len(core.sequences) == 0
    for rank in sim.decode_pool.ranks.values():
        assert not rank.sched.has_work and rank.sched.kv.num_active_blocks == 0


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_a_bad_frontend_time_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="--frontend-ms"):
        Deployment(1, frontend_ms=bad)


def test_the_flag_sets_it() -> None:
    args = build_parser().parse_args(["--frontend-ms", "2.5", "--workers", "3"])
    assert deployment(args).frontend_ms == 2.5
    assert deployment(build_parser().parse_args([])).frontend_ms == 0.0

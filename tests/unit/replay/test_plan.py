"""dynamo plan: a sweep of replays judged against an SLO, cheapest first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo.bench.config import BenchConfig
from dynamo.mocker.config import MockerConfig
from dynamo.replay.deployment import Deployment
from dynamo.replay.plan import SLO, Sweep, main, plan, write_plan

BENCH = BenchConfig(
    url="replay:",
    workload="prefix",
    prefix_groups=8,
    prefix_len=512,
    suffix_len=64,
    osl=16,
    concurrency=8,
    num_requests=40,
)
BASE = Deployment(engine=MockerConfig(num_gpu_blocks=512, block_size=16))


def test_cheapest_configuration_meeting_the_slo(tmp_path: Path) -> None:
    sweep = Sweep(workers=(1, 2, 3), router_modes=("kv", "round-robin"))
    loose = plan(BENCH, BASE, SLO(ttft_ms=10_000), sweep)
    assert len(loose.outcomes) == 6 and loose.best is not None
    assert loose.best.cost == 1  # everything meets a loose SLO: the cheapest wins
    # an ITL target between the 1-worker and the 3-worker figures rules the single worker out
    itl = {
        o.deployment.workers: o.itl_ms for o in loose.outcomes if o.deployment.router_mode == "kv"
    }
    assert itl[1] is not None and itl[3] is not None and itl[3] < itl[1]
    target = (itl[1] + itl[3]) / 2
    tight = plan(BENCH, BASE, SLO(itl_ms=target, itl_percentile="p90"), sweep)
    assert tight.best is not None and tight.best.cost > 1
    assert all(o.itl_ms is not None and o.itl_ms <= target for o in tight.feasible)
    assert [o.cost for o in tight.feasible] == sorted(o.cost for o in tight.feasible)
    assert [o.cost for o in tight.frontier()] == [1, 2, 3]
    written = write_plan(tmp_path, tight)
    assert [p.name for p in written] == ["plan.json", "frontier.png"]
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["best"]["cost_engines"] == tight.best.cost and len(saved["outcomes"]) == 6


def test_headroom_tightens_the_targets() -> None:
    slo = SLO(ttft_ms=100.0, itl_ms=20.0, headroom=0.25)
    assert slo.meets(75.0, 15.0) and not slo.meets(76.0, 15.0) and not slo.meets(75.0, 16.0)
    with pytest.raises(ValueError):
        SLO(ttft_ms=1.0, headroom=1.0)


def test_impossible_slo_has_no_best() -> None:
    result = plan(BENCH, BASE, SLO(ttft_ms=0.001), Sweep(workers=(1,)))
    assert result.best is None and not result.feasible


def test_sweep_covers_disaggregated_splits() -> None:
    sweep = Sweep(workers=(1, 2), prefill_workers=(0, 1), overlap_weights=(0.5, 1.0))
    deployments = sweep.deployments(BASE)
    assert len(deployments) == 8
    assert {(d.prefill_workers, d.workers) for d in deployments} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    assert {d.kv.overlap_score_weight for d in deployments} == {0.5, 1.0}


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--workload", "synthetic", "--isl", "64", "--osl", "4", "--num-requests", "8",
        "--concurrency", "2", "--block-size", "16", "--num-gpu-blocks-override", "256",
        "--sweep-workers", "1,2", "--slo-ttft-ms", "1000", "--output-dir", str(tmp_path),
        "--no-plots",
    ]  # fmt: skip
    assert main(args) == 0
    assert "2 of 2 configurations meet the SLO" in capsys.readouterr().out
    assert (tmp_path / "plan.json").exists() and not (tmp_path / "frontier.png").exists()
    assert main([*args[:-5], "--slo-ttft-ms", "0.001"]) == 1
    assert main(["--sweep-workers", "0", "--slo-ttft-ms", "1"]) == 2
    assert main(["--num-requests", "1"]) == 2  # no SLO given
    assert "dynamo plan: give an SLO" in capsys.readouterr().err

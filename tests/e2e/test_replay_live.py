"""The replay against the live stack (``dynamo serve`` + ``dynamo bench``) at speedup 1: the
kv-routing workload of FACTS §12, and a ``dynamo plan`` pick that must meet its SLO live."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from dynamo.bench import BenchConfig, run_benchmark
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.timing import prefill_ms
from dynamo.replay.deployment import Deployment
from dynamo.replay.plan import SLO, Sweep, plan
from dynamo.replay.run import run_replay
from tests.e2e.processes import Child

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINE_FLAGS = ["--block-size", "16", "--num-gpu-blocks-override", "512", "--speedup-ratio", "1"]
ENGINE = MockerConfig(num_gpu_blocks=512, block_size=16, speedup_ratio=1.0)
KV_WORKLOAD: dict[str, Any] = {
    "workload": "prefix",
    "prefix_groups": 16,
    "prefix_len": 1024,
    "suffix_len": 128,
    "osl": 32,
    "concurrency": 32,
    "num_requests": 320,
}


class LiveServe:
    """``dynamo serve`` on an ephemeral port with ``workers`` mocker processes."""

    def __init__(self, workers: int, router_mode: str, discovery_dir: str) -> None:
        import os

        env = dict(os.environ, PYTHONUNBUFFERED="1", DYN_FILE_KV=discovery_dir)
        args = ["-m", "dynamo.serve", "--http-host", "127.0.0.1", "--http-port", "0"]
        args += ["--workers", str(workers), "--router-mode", router_mode, *ENGINE_FLAGS]
        self.child = Child(args, env)
        line = self.child.wait_for_line("dynamo frontend: listening on http://", timeout=90)
        self.url = f"http://127.0.0.1:{int(line.rsplit(':', 1)[1])}"

    def bench(self, **config: Any) -> dict[str, Any]:
        options: dict[str, Any] = {"api": "completions", "progress": False, "plots": False}
        options.update(config)
        result = asyncio.run(run_benchmark(BenchConfig(url=self.url, **options)))
        return result.summary

    def wait_for_workers(self, workers: int) -> None:
        """Every worker serves: one request per worker at a time would otherwise hit one."""
        for _ in range(300):
            s = self.bench(workload="synthetic", isl=32, osl=2, num_requests=workers * 2,
                           concurrency=workers)  # fmt: skip
            if s["requests"]["failed"] == 0:
                break
        assert s["requests"]["failed"] == 0

    def stop(self) -> None:
        self.child.stop()


@pytest.fixture
def live_kv(discovery_dir: str) -> Iterator[LiveServe]:
    serve = LiveServe(4, "kv", discovery_dir)
    try:
        serve.wait_for_workers(4)
        yield serve
    finally:
        serve.stop()


def _close(live: float, replay: float, rel: float) -> bool:
    return abs(live - replay) <= rel * abs(live)


def test_replay_agrees_with_the_live_stack(live_kv: LiveServe) -> None:
    # The frontend's own share of TTFT, measured on the idle stack: one request's TTFT minus
    # the model's prefill time for it.
    probe = live_kv.bench(workload="synthetic", isl=64, osl=2, num_requests=5, seed=99)
    overhead_ms = probe["ttft_ms"]["p50"] - prefill_ms(64)
    live = live_kv.bench(**KV_WORKLOAD)
    replay = run_replay(
        BenchConfig(url="replay:", **KV_WORKLOAD), Deployment(4, "kv", engine=ENGINE)
    )
    sim = replay.summary
    report = (
        f"live hit {live['cache_hit_rate']:.3f} itl {live['itl_ms']['mean']:.2f} "
        f"ttft p50 {live['ttft_ms']['p50']:.1f} | replay hit {sim['cache_hit_rate']:.3f} "
        f"itl {sim['itl_ms']['mean']:.2f} ttft p50 {sim['ttft_ms']['p50']:.1f} | "
        f"overhead {overhead_ms:.1f} ms"
    )
    assert live["requests"]["failed"] == 0, report
    assert _close(live["cache_hit_rate"], sim["cache_hit_rate"], 0.05), report
    assert _close(live["itl_ms"]["mean"], sim["itl_ms"]["mean"], 0.05), report
    gap = live["ttft_ms"]["p50"] - sim["ttft_ms"]["p50"]
    # Under load the frontend queues as well: its idle overhead per request in flight on a
    # worker's pass (a closed loop of 32 requests over 4 workers batches ~8 arrivals together).
    assert -0.05 * sim["ttft_ms"]["p50"] <= gap <= max(8 * overhead_ms, 25.0), report


PLAN_WORKLOAD: dict[str, Any] = {
    "workload": "prefix",
    "prefix_groups": 8,
    "prefix_len": 512,
    "suffix_len": 64,
    "osl": 16,
    "concurrency": 8,
    "num_requests": 80,
}


def test_plan_pick_meets_the_slo_live(discovery_dir: str) -> None:
    """An ITL target that one worker misses in the replay: the plan picks more, and that
    deployment, served for real, meets the SLO."""
    slo = SLO(ttft_ms=250.0, itl_ms=27.0, ttft_percentile="p90", itl_percentile="p90")
    bench = BenchConfig(url="replay:", **PLAN_WORKLOAD)
    result = plan(bench, Deployment(engine=ENGINE), slo, Sweep(workers=(1, 2, 3)))
    assert [o.meets_slo for o in result.outcomes][0] is False  # one worker is not enough
    best = result.best
    assert best is not None and best.deployment.workers in (2, 3)
    serve = LiveServe(best.deployment.workers, best.deployment.router_mode, discovery_dir)
    try:
        serve.wait_for_workers(best.deployment.workers)
        live = serve.bench(**PLAN_WORKLOAD)
    finally:
        serve.stop()
    report = f"live ttft p90 {live['ttft_ms']['p90']:.1f} itl p90 {live['itl_ms']['p90']:.1f}"
    assert live["requests"]["failed"] == 0, report
    assert live["ttft_ms"]["p90"] <= slo.ttft_ms, report
    assert live["itl_ms"]["p90"] <= slo.itl_ms, report

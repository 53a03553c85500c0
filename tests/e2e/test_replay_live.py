"""The replay against the live stack (``dynamo serve`` + ``dynamo bench``) at speedup 1: the
kv-routing workload of FACTS §12, and a ``dynamo plan`` pick that must meet its SLO live."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from dynamo.bench import BenchConfig, run_benchmark
from dynamo.bench.benchmark import BenchError
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.timing import prefill_ms
from dynamo.replay.deployment import Deployment
from dynamo.replay.plan import SLO, Sweep, plan
from dynamo.replay.run import run_replay
from tests.e2e.processes import Child

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINE_FLAGS = ["--block-size", "16", "--num-gpu-blocks-override", "512", "--speedup-ratio", "1"]
ENGINE = MockerConfig(num_gpu_blocks=512, block_size=16, speedup_ratio=1.0)
REPLAY_SEEDS = 8
"""Router seeds the replay side of the agreement test runs (0.1-0.2 s each)."""
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
        failed = -1
        for _ in range(300):
            try:
                s = self.bench(workload="synthetic", isl=32, osl=2, num_requests=workers * 2,
                               concurrency=workers)  # fmt: skip
            except BenchError:  # listening before the first worker's model is registered
                time.sleep(0.2)
                continue
            failed = s["requests"]["failed"]
            if failed == 0:
                break
        assert failed == 0

    def stop(self) -> None:
        self.child.stop()


LIVE_ATTEMPTS = 3
"""Live runs a check may take: the first that meets the bounds passes. The bounds are the
issue's in every attempt; a busy neighbour that stalls one run does not fail the test, a stack
that disagrees with the replay fails every run."""
LIVE_NICE = -10
"""The live stack's CPU priority (children inherit it from the test process): on a host with
more runnable work than cores the live engines then keep the model's pace, which is what the
replay models. Only a privileged user may raise it; otherwise the stack runs as it is."""


@contextmanager
def raised_priority() -> Iterator[None]:
    """Run the block, and the processes it starts, at ``LIVE_NICE`` (restored after)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(before, LIVE_NICE))
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


@pytest.fixture
def live_kv(discovery_dir: str) -> Iterator[LiveServe]:
    with raised_priority():
        serve = LiveServe(4, "kv", discovery_dir)
        try:
            serve.wait_for_workers(4)
            yield serve
        finally:
            serve.stop()


def _close(live: float, replay: float, rel: float) -> bool:
    return abs(live - replay) <= rel * abs(live)


def _replay_hits(frontend_ms: float) -> list[float]:
    """The replay's hit rate of the kv-routing workload under each router seed, with the
    frontend modelled at ``frontend_ms`` a request (``Deployment.frontend_ms``)."""
    bench = BenchConfig(url="replay:", **KV_WORKLOAD)
    return [
        run_replay(
            bench, Deployment(4, "kv", engine=ENGINE, router_seed=s, frontend_ms=frontend_ms)
        ).summary["cache_hit_rate"]
        for s in range(REPLAY_SEEDS)
    ]


def _agreement(live_kv: LiveServe, sim: dict[str, Any], hits: list[float], n: int) -> list[str]:
    """One live run of the kv-routing workload against the replay: the figures, and each
    bound it misses (none: it agrees)."""
    # The frontend's own share of TTFT, measured on the idle stack just before: one request's
    # TTFT minus the model's prefill time for it; for the workload's prompt size as well
    # (fresh prompts each attempt: a cached prefix would shorten the prefill).
    probe = live_kv.bench(workload="synthetic", isl=64, osl=2, num_requests=5, seed=99 + n)
    overhead_ms = probe["ttft_ms"]["p50"] - prefill_ms(64)
    isl = KV_WORKLOAD["prefix_len"] + KV_WORKLOAD["suffix_len"]
    probe = live_kv.bench(workload="synthetic", isl=isl, osl=2, num_requests=5, seed=199 + n)
    frontend_ms = max(0.0, probe["ttft_ms"]["p50"] - prefill_ms(isl))
    # A closed loop's first wave reaches the live router spread out by the frontend's own time
    # a request, so its tail is routed with its head's KV events in the index: the replay
    # under that frontend time as well (the live hit rate is one draw between the two).
    hits = hits + _replay_hits(frontend_ms)
    live = live_kv.bench(**KV_WORKLOAD)
    report = (
        f"live hit {live['cache_hit_rate']:.3f} itl {live['itl_ms']['mean']:.2f} "
        f"ttft p50 {live['ttft_ms']['p50']:.1f} | replay hit {sim['cache_hit_rate']:.3f} "
        f"(router seeds, frontend 0 and {frontend_ms:.1f} ms: {min(hits):.3f}-{max(hits):.3f}) "
        f"itl {sim['itl_ms']['mean']:.2f} ttft p50 {sim['ttft_ms']['p50']:.1f} | "
        f"overhead {overhead_ms:.1f} ms | load {os.getloadavg()[0]:.1f}"
    )
    print(report)  # the figures, for docs/performance.md (pytest -s)
    missed = []
    if live["requests"]["failed"]:
        missed.append("failed requests")
    # The 5 %, against the replay's tie-break spread rather than one draw of it.
    margin = 0.05 * live["cache_hit_rate"]
    if not min(hits) - margin <= live["cache_hit_rate"] <= max(hits) + margin:
        missed.append("hit rate")
    if not _close(live["itl_ms"]["mean"], sim["itl_ms"]["mean"], 0.05):
        missed.append("ITL")
    # Under load the frontend queues as well: its idle overhead per request arriving in one of
    # a worker's passes (32 requests in flight over 4 workers: ~8 per pass), at least the 25 ms
    # FACTS §12 measured on the reference.
    gap = live["ttft_ms"]["p50"] - sim["ttft_ms"]["p50"]
    if not -0.05 * sim["ttft_ms"]["p50"] <= gap <= max(8 * overhead_ms, 25.0):
        missed.append("TTFT p50")
    return [f"{report} | missed: {', '.join(missed)}"] if missed else []


def test_replay_agrees_with_the_live_stack(live_kv: LiveServe) -> None:
    bench = BenchConfig(url="replay:", **KV_WORKLOAD)
    sim = run_replay(bench, Deployment(4, "kv", engine=ENGINE)).summary
    # The same prompts under other router seeds: on 320 requests the KV router's random
    # tie-breaks alone move the hit rate by ~2.6 % (sd; 0.66-0.72 over 12 seeds), and the live
    # run is one more such draw (its timing jitter changes the tie-breaks).
    hits = _replay_hits(0.0)
    misses: list[str] = []
    for n in range(LIVE_ATTEMPTS):  # at the fixture's raised priority
        missed = _agreement(live_kv, sim, hits, n)
        if not missed:
            return
        misses += missed
    pytest.fail("\n".join(misses))


# Prompts of 68 KV blocks with their output: 7 fit one worker's 512 blocks, so 28 in flight
# queue for seconds on fewer than 4 workers and not at all on 4.
PLAN_WORKLOAD: dict[str, Any] = {
    "workload": "synthetic",
    "isl": 1024,
    "osl": 64,
    "concurrency": 28,
    "num_requests": 84,
}


def test_plan_pick_meets_the_slo_live(discovery_dir: str) -> None:
    """A TTFT target that fewer workers miss in the replay: the plan picks the cheapest that
    meets it, and that deployment, served for real, meets the SLO (planned with 25 % headroom
    for the frontend, the transport and a busy host, which the replay does not model)."""
    slo = SLO(ttft_ms=1000.0, itl_ms=60.0, headroom=0.25)
    bench = BenchConfig(url="replay:", **PLAN_WORKLOAD)
    result = plan(bench, Deployment(engine=ENGINE), slo, Sweep(workers=(1, 2, 4)))
    assert [o.meets_slo for o in result.outcomes] == [False, False, True]
    best = result.best
    assert best is not None and best.deployment.workers == 4
    reports = []
    with raised_priority():
        serve = LiveServe(best.deployment.workers, best.deployment.router_mode, discovery_dir)
        try:
            serve.wait_for_workers(best.deployment.workers)
            for _ in range(LIVE_ATTEMPTS):
                live = serve.bench(**PLAN_WORKLOAD)
                ttft, itl = live["ttft_ms"]["p90"], live["itl_ms"]["p90"]
                reports.append(f"live ttft p90 {ttft:.1f} itl p90 {itl:.1f}")
                assert live["requests"]["failed"] == 0, reports
                if ttft <= slo.ttft_ms and itl <= slo.itl_ms:
                    return
        finally:
            serve.stop()
    pytest.fail(f"the SLO missed in every live run: {reports}")

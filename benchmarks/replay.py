"""Offline replay speed (issue 18): the kv-routing workload (16 prefix groups of 1024 + 128
tokens, OSL 32, closed loop c=32, 512 blocks of 16, speedup 1) with the KV router.

    python benchmarks/replay.py                      # 20k requests / 4 workers, then 100k / 100
    python benchmarks/replay.py --requests 20000 --skip-large --profile

For each run: wall and CPU seconds (the whole ``run_replay`` call: building the prompts,
simulating, summarizing; CPU time is the fairer figure on a shared, loaded machine), simulated
seconds, and the cyclic collector's collections and thread CPU inside that call (``gc_ms``).
With the reference (ai-dynamo 1.6.1's Rust replay) in
``--ref-python`` (default ``/work/refvenv/bin/python``), the same shape runs there side by side
(``dynamo.replay.run_synthetic_trace_replay``, from /tmp so its ``dynamo`` package is the one
imported). ``--rounds N`` alternates the two N times and prints the CPU ratio of each round,
their median and the best (one pair is one draw of this VM's noise). ``--profile`` prints the
top of a cProfile of our 20k run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dynamo.bench.config import BenchConfig
from dynamo.mocker.config import MockerConfig
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import prompt_builder, run_replay
from dynamo.runtime.heap import settle_after_start

ISL_PREFIX, ISL_SUFFIX, OSL, GROUPS, CONCURRENCY = 1024, 128, 32, 16, 32
ENGINE = MockerConfig(num_gpu_blocks=512, block_size=16, speedup_ratio=1.0)

_REF_SCRIPT = f"""
import json, sys, time
from dynamo.replay import run_synthetic_trace_replay
n, workers = int(sys.argv[1]), int(sys.argv[2])
t = time.perf_counter()
report = run_synthetic_trace_replay(
    {ISL_PREFIX + ISL_SUFFIX}, {OSL}, n,
    extra_engine_args={{
        "engine": {{"block_size": 16, "num_gpu_blocks": 512, "speedup_ratio": 1.0}}
    }},
    num_workers=workers, replay_concurrency={CONCURRENCY}, router_mode="kv_router",
    shared_prefix_ratio={ISL_PREFIX / (ISL_PREFIX + ISL_SUFFIX)}, num_prefix_groups={GROUPS},
)
wall = time.perf_counter() - t
data = report if isinstance(report, dict) else getattr(report, "__dict__", {{}})
summary = data.get("summary", data) if isinstance(data, dict) else {{}}
def pick(*names):
    for name in names:
        if isinstance(summary, dict) and name in summary:
            return summary[name]
    return None
print(json.dumps({{"wall_s": wall, "duration_ms": pick("duration_ms"),
                   "hit": pick("prefix_cache_reused_ratio"),
                   "itl_mean_ms": pick("mean_itl_ms", "itl_mean_ms"),
                   "ttft_p50_ms": pick("p50_ttft_ms", "median_ttft_ms", "ttft_p50_ms")}}))
"""


class _CollectorTime:
    """The cyclic collector's collections and thread CPU time while counting (``gc.callbacks``:
    a call a collection, nothing between them)."""

    def __init__(self) -> None:
        self.collections = 0
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> _CollectorTime:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.collections += 1
            self.seconds += time.thread_time() - self._started


def ours(requests: int, workers: int, *, profile: bool = False) -> dict[str, Any]:
    bench = BenchConfig(
        url="replay:",
        workload="prefix",
        prefix_groups=GROUPS,
        prefix_len=ISL_PREFIX,
        suffix_len=ISL_SUFFIX,
        osl=OSL,
        concurrency=CONCURRENCY,
        num_requests=requests,
    )
    deployment = Deployment(workers, "kv", engine=ENGINE)
    started, cpu = time.perf_counter(), time.process_time()
    with _CollectorTime() as collector:
        if profile:
            prof = cProfile.Profile()
            result = prof.runcall(run_replay, bench, deployment)
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        else:
            result = run_replay(bench, deployment)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    s = result.summary
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "simulation_wall_s": s["replay"]["simulation_wall_s"],
        "simulated_s": s["replay"]["simulated_s"],
        "hit": s["cache_hit_rate"],
        "itl_mean_ms": s["itl_ms"]["mean"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "rps": s["request_throughput_rps"],
        "gc_collections": collector.collections,
        "gc_ms": collector.seconds * 1000,
    }


def reference(python: str, requests: int, workers: int) -> dict[str, Any] | None:
    if not Path(python).exists():
        return None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [python, "-c", _REF_SCRIPT, str(requests), str(workers)],
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=1800,
        # its per-decision INFO logs would dominate its time
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"DYN_LOG": "warn"},
    )
    if proc.returncode != 0:
        print(f"reference failed: {proc.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    # the child's whole CPU time (interpreter start and import included)
    out["cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--large-requests", type=int, default=100_000)
    p.add_argument("--large-workers", type=int, default=100)
    p.add_argument("--skip-large", action="store_true")
    p.add_argument("--ref-python", default="/work/refvenv/bin/python")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate ours and the reference this many times and print the median ratio "
        "(this VM's CPU time moves up to 2x between runs of one program)",
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    prompt_builder(None)  # the demo tokenizer's word pool: loaded once, not timed
    settle_after_start()  # the collector as ``dynamo replay``'s process has it (dynamo.cli)
    runs = [(args.requests, args.workers)]
    if not args.skip_large:
        runs.append((args.large_requests, args.large_workers))
    for requests, workers in runs:
        ratios = []
        for _ in range(args.rounds):
            mine = ours(requests, workers, profile=args.profile and requests == args.requests)
            shape = f"{requests} requests, {workers} workers"
            print(f"ours      {shape}: {json.dumps(mine)}", flush=True)
            if not args.no_reference:
                ref = reference(args.ref_python, requests, workers)
                print(f"reference {shape}: {json.dumps(ref)}", flush=True)
                if ref is not None:
                    ratios.append(mine["cpu_s"] / ref["cpu_s"])
        if ratios:
            listed = ", ".join(f"{r:.2f}" for r in ratios)
            print(
                f"CPU ours / reference, {requests} requests, {workers} workers: {listed} "
                f"(median {statistics.median(ratios):.2f}, best {min(ratios):.2f})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

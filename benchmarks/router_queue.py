"""The router queue (issue 17, FACTS §4.5) under overload: TTFT with and without it.

The offline replay (the live KV router's ``RoutingCore`` and ``PendingQueue`` on a virtual clock,
the mocker's scheduler and timing model) so the figures are deterministic and do not depend on
the machine's load: 4 workers (mocker defaults, speedup 1), mixed prompts (synthetic, ISL 2048
± 1536 normal spread, OSL 64), Poisson arrivals at 80/s, past the deployment's capacity. Rows:
no queue; fcfs and wspt at a few thresholds. Figures: TTFT mean / p50 / p99 and e2e p99 (ms),
requests completed, the wall and CPU seconds of each replay.

    .venv/bin/python benchmarks/router_queue.py [--rate 80] [--requests 600] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from dynamo.bench.config import BenchConfig
from dynamo.mocker.config import MockerConfig
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import run_replay
from dynamo.router.config import KVRouterSettings

WORKERS = 4
ENGINE = MockerConfig(block_size=16, speedup_ratio=1.0)
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("no queue", {}),
    ("fcfs t=2.0", {"queue_threshold": 2.0}),
    ("fcfs t=1.0", {"queue_threshold": 1.0}),
    ("fcfs t=0.5", {"queue_threshold": 0.5}),
    ("wspt t=2.0", {"queue_threshold": 2.0, "queue_policy": "wspt"}),
    ("wspt t=1.0", {"queue_threshold": 1.0, "queue_policy": "wspt"}),
    ("wspt t=0.5", {"queue_threshold": 0.5, "queue_policy": "wspt"}),
]


def one(rate: float, requests: int, seed: int, kv: dict[str, Any]) -> dict[str, Any]:
    bench = BenchConfig(
        url="replay:",
        workload="synthetic",
        isl=2048,
        isl_stddev=1536,
        osl=64,
        rate=rate,
        num_requests=requests,
        seed=seed,
    )
    deployment = Deployment(WORKERS, "kv", kv=KVRouterSettings(**kv), engine=ENGINE)
    cpu, wall = time.process_time(), time.perf_counter()
    summary = run_replay(bench, deployment).summary
    ttft, e2e = summary["ttft_ms"], summary["e2e_latency_ms"]
    return {
        "ttft_mean_ms": round(ttft["mean"], 1),
        "ttft_p50_ms": round(ttft["p50"], 1),
        "ttft_p99_ms": round(ttft["p99"], 1),
        "e2e_p99_ms": round(e2e["p99"], 1),
        "completed": summary["requests"]["completed"],
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=80.0, help="arrivals per second")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args()
    print(f"# load average {os.getloadavg()[0]:.1f}; rate {args.rate}/s, {args.requests} requests")
    if not args.json:
        print(f"{'config':<12} {'mean':>8} {'p50':>8} {'p99':>8} {'e2e p99':>9} {'done':>5}")
    for name, kv in CONFIGS:
        row = one(args.rate, args.requests, args.seed, kv)
        if args.json:
            print(json.dumps({"config": name, **row}))
        else:
            print(
                f"{name:<12} {row['ttft_mean_ms']:>8} {row['ttft_p50_ms']:>8} "
                f"{row['ttft_p99_ms']:>8} {row['e2e_p99_ms']:>9} {row['completed']:>5}"
            )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

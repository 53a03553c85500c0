"""KV routing benchmark (issue 5): KV-aware routing against round-robin on the same workload.

Per run, a fresh stack: ``dynamo serve`` with 4 mocker workers (512 KV blocks each, block size 16,
speedup 1) and the given router mode; then ``dynamo bench``: 16 prefix groups of 1024 tokens plus
128 unique tokens each, OSL 32, concurrency 32, 320 requests (completions, token-id prompts).
Three runs per mode; the median run per figure is reported.

Reference on the 2-core VM: kv TTFT p50 95.6 ms, p99 312 ms, cache hit rate 0.70; round-robin
130 ms, 1147 ms, 0.34. Goal: at least the reference's gain on every figure (p50 cut >= 26 %, p99
cut >= 73 %, hit rate >= 0.70).

    .venv/bin/python benchmarks/kv_routing.py [--runs 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launcher import REPO, Child, free_port, service_env, wait_model  # noqa: E402

from dynamo.bench import BenchConfig, run_benchmark  # noqa: E402
from dynamo.bench.__main__ import run_loop  # noqa: E402

MOCKER_FLAGS = ["--num-gpu-blocks-override", "512", "--block-size", "16", "--speedup-ratio", "1"]
REFERENCE = {
    "kv": {"ttft_p50_ms": 95.6, "ttft_p99_ms": 312.0, "cache_hit_rate": 0.70},
    "round-robin": {"ttft_p50_ms": 130.0, "ttft_p99_ms": 1147.0, "cache_hit_rate": 0.34},
}


def one_run(
    mode: str, seed: int, requests: int, flags: Sequence[str] = (), name: str | None = None
) -> dict[str, Any]:
    """One fresh ``dynamo serve`` stack (``flags`` added to its command line) and the workload;
    ``benchmarks/distributed.py`` runs it per discovery / event-plane shape."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dynamo-kv-bench-") as tmp:
        serve = Child(
            name or f"serve-{mode}",
            ["-m", "dynamo.serve", "--http-host", "127.0.0.1", "--http-port", str(port)]
            + ["--workers", "4", "--router-mode", mode, *flags, *MOCKER_FLAGS],
            service_env(TMPDIR=tmp),
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_model(url)
            config = BenchConfig(
                url=url,
                api="completions",
                workload="prefix",
                prefix_groups=16,
                prefix_len=1024,
                suffix_len=128,
                osl=32,
                concurrency=32,
                num_requests=requests,
                warmup=0,
                seed=seed,
                progress=False,
                plots=False,
            )
            summary = run_loop(run_benchmark(config)).summary
        finally:
            serve.stop()
    return {
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "cache_hit_rate": summary["cache_hit_rate"],
        "req_per_s": summary["request_throughput_rps"],
        "errors": summary["errors"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--out", default=str(REPO / "bench-results" / "kv_routing.json"))
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for mode in ("kv", "round-robin"):
        runs = [one_run(mode, seed=100 + i, requests=args.requests) for i in range(args.runs)]
        for r in runs:
            print(
                f"{mode:>12}: TTFT p50 {r['ttft_p50_ms']:.1f} ms, p99 {r['ttft_p99_ms']:.1f} ms,"
                f" hit rate {r['cache_hit_rate']:.2f}, {r['req_per_s']:.1f} req/s",
                flush=True,
            )
        results[mode] = {
            "runs": runs,
            "median": {
                k: statistics.median(r[k] for r in runs)
                for k in ("ttft_p50_ms", "ttft_p99_ms", "cache_hit_rate", "req_per_s")
            },
        }
    kv, rr = results["kv"]["median"], results["round-robin"]["median"]
    gains = {
        "ttft_p50_cut": 1 - kv["ttft_p50_ms"] / rr["ttft_p50_ms"],
        "ttft_p99_cut": 1 - kv["ttft_p99_ms"] / rr["ttft_p99_ms"],
        "kv_cache_hit_rate": kv["cache_hit_rate"],
    }
    goal = {"ttft_p50_cut": 0.26, "ttft_p99_cut": 0.73, "kv_cache_hit_rate": 0.70}
    print("\nmedians:")
    for mode in ("kv", "round-robin"):
        m = results[mode]["median"]
        print(
            f"{mode:>12}: TTFT p50 {m['ttft_p50_ms']:.1f} ms, p99 {m['ttft_p99_ms']:.1f} ms,"
            f" hit rate {m['cache_hit_rate']:.2f}"
        )
    for key, value in gains.items():
        print(f"{key}: {value:.2f} (goal >= {goal[key]:.2f})")
    report = {
        "benchmark": "kv_routing",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "reference": REFERENCE,
        "goal": goal,
        "gains": gains,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

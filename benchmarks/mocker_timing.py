"""Mocker timing fidelity through the whole stack (issue 12): does the decode interval a client
sees equal the timing model's?

A fresh frontend + one mocker at speedup 1 (each its own process, file discovery, TCP plane),
then ``dynamo bench``: completions with token-id prompts of ISL 1024, OSL 8, one request at a
time (c=1), distinct prompts (no prefix-cache hits). The model's decode time for those contexts is
D(1025..1031) = 5.79 ms (FACTS §6.4); the reference measures 5.79 ms the same way. Before the
step loop paced passes against absolute deadlines this measured 6.41 ms. Goal: the mean within
1 % of the model.

    .venv/bin/python benchmarks/mocker_timing.py [--requests 200] [--runs 3]

Results: a table on stdout and JSON in ``bench-results/mocker_timing.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launcher import MODEL, REPO, Child, service_env, wait_model  # noqa: E402

from dynamo.bench import BenchConfig, run_benchmark  # noqa: E402
from dynamo.bench.__main__ import run_loop  # noqa: E402
from dynamo.mocker.timing import decode_ms, prefill_ms  # noqa: E402

TOTAL_KV_TOKENS = 16384 * 64  # mocker defaults
REFERENCE_ITL_MS = 5.79
BEFORE_ITL_MS = 6.41


def one_run(isl: int, osl: int, requests: int, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dynamo-timing-bench-") as discovery:
        env = service_env(discovery)
        mocker = Child(
            "mocker",
            ["-m", "dynamo.mocker", "--model-path", str(MODEL), "--model-name", "demo"]
            + ["--speedup-ratio", "1"],
            env,
        )
        frontend = Child(
            "frontend",
            ["-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", "0"],
            env,
        )
        try:
            url = f"http://127.0.0.1:{frontend.port()}"
            wait_model(url)
            config = BenchConfig(
                url=url,
                api="completions",
                isl=isl,
                osl=osl,
                concurrency=1,
                num_requests=requests,
                warmup=10,
                seed=seed,
                progress=False,
                plots=False,
            )
            result = run_loop(run_benchmark(config))
        finally:
            frontend.stop()
            mocker.stop()
    summary = result.summary
    # The mean step time a client sees: first to last token over the tokens in between. Robust
    # to the frontend merging two tokens into one chunk (a token whose text is an incomplete
    # UTF-8 sequence waits for the next), which drops a gap from the ITL list and doubles one.
    steps = [
        sum(r.itl) / (r.output_tokens - 1) for r in result.records if r.ok and r.output_tokens > 1
    ]
    return {
        "decode_interval_mean_ms": statistics.fmean(steps) * 1000,
        "decode_interval_p50_ms": statistics.median(steps) * 1000,
        "itl_mean_ms": summary["itl_ms"]["mean"],
        "tpot_mean_ms": summary["tpot_ms"]["mean"],
        "itl_p50_ms": summary["itl_ms"]["p50"],
        "itl_p99_ms": summary["itl_ms"]["p99"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "errors": summary["errors"],
    }


def _pct(value: float, model: float) -> str:
    return f"{(value / model - 1) * 100:+.2f} %"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isl", type=int, default=1024)
    parser.add_argument("--osl", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench-results/mocker_timing.json")
    args = parser.parse_args(argv)
    model_itl = statistics.fmean(
        decode_ms(args.isl + i, TOTAL_KV_TOKENS) for i in range(1, args.osl)
    )
    runs = []
    for r in range(args.runs):
        runs.append(one_run(args.isl, args.osl, args.requests, seed=7000 + r))
        row = runs[-1]
        print(
            f"run {r + 1}: decode interval {row['decode_interval_mean_ms']:.3f} ms"
            f" ({_pct(row['decode_interval_mean_ms'], model_itl)}), model {model_itl:.3f},"
            f" p50 {row['decode_interval_p50_ms']:.3f};"
            f" ITL mean {row['itl_mean_ms']:.3f} ({_pct(row['itl_mean_ms'], model_itl)}),"
            f" p50 {row['itl_p50_ms']:.3f}, p99 {row['itl_p99_ms']:.3f};"
            f" TPOT mean {row['tpot_mean_ms']:.3f} ({_pct(row['tpot_mean_ms'], model_itl)});"
            f" TTFT p50 {row['ttft_p50_ms']:.2f} ms (model {prefill_ms(args.isl):.2f})",
            flush=True,
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    report = {
        "benchmark": "mocker_timing",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "isl": args.isl,
        "osl": args.osl,
        "model_itl_ms": model_itl,
        "goal": "decode interval (mean step time seen by the client) within 1 % of the model",
        "reference_itl_ms": REFERENCE_ITL_MS,
        "before_itl_ms": BEFORE_ITL_MS,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

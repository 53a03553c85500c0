"""Disaggregation benchmark (issue 16): 4 aggregated mocker workers against 2 prefill + 2 decode
workers in both prefill dispatch modes (``route``: a KV router over the prefill workers;
``queue``: the global prefill queue they pull from, hosted by the frontend over its TCP request
plane), on the same open-loop mixed workload, same run.

Workload: 20 % long prompts (4000-7900 tokens: the demo model's context is 8192), 80 % chat
turns of 200-500 tokens, OSL 200 (ignore_eos), Poisson arrivals at ``--rate`` req/s, completions
with token-id prompts (exact lengths, no prefix sharing). Mockers at speedup 1 with the
reference's KV-transfer model (64 GB/s, 131072 bytes per token: an 8B-class model), each stack
started with ``dynamo serve`` (file discovery, TCP request plane, ZMQ events), router ``kv``.

Per stack: TTFT and ITL p50/p99 (ITL over every inter-token gap of every request) and goodput:
requests per second meeting the SLO TTFT <= 2 s and mean ITL <= 50 ms. Goal: disaggregation
(each dispatch mode) cuts ITL p99 by at least half at equal goodput or better.

    .venv/bin/python benchmarks/disagg.py [--rate 12] [--duration 45]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launcher import Child, free_port, service_env, wait_model  # noqa: E402

from dynamo.bench.benchmark import check_server  # noqa: E402
from dynamo.bench.client import Endpoint, HttpClient  # noqa: E402
from dynamo.bench.report import percentile  # noqa: E402
from dynamo.bench.request import RequestRecord, RequestSpec, Sender  # noqa: E402
from dynamo.bench.runner import Budget, LoadRunner  # noqa: E402
from dynamo.bench.workload import SingleRequest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MOCKER = [
    "--speedup-ratio",
    "1",
    "--kv-bytes-per-token",
    "131072",
    "--kv-transfer-bandwidth",
    "64",
]
STACKS = {
    "agg 4": ["--workers", "4"],
    "disagg 2P+2D route": ["--prefill-workers", "2", "--decode-workers", "2"],
    "disagg 2P+2D queue": [
        *("--prefill-workers", "2", "--decode-workers", "2"),
        *("--prefill-dispatch", "queue"),
    ],
}
SLO_TTFT_S = 2.0
SLO_ITL_S = 0.050
VOCAB = (1000, 4000)  # plain word-piece ids of the demo tokenizer (no special tokens)


def workload(rate: float, duration: float, seed: int) -> list[SingleRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(int(rate * duration * 1.5) + 10):
        isl = rng.randint(4000, 7900) if rng.random() < 0.2 else rng.randint(200, 500)
        prompt = [rng.randrange(*VOCAB) for _ in range(isl)]
        spec = RequestSpec(max_tokens=200, expected_prompt_tokens=isl, prompt=prompt)
        out.append(SingleRequest(spec))
    return out


async def load(url: str, rate: float, duration: float, seed: int) -> list[RequestRecord]:
    import time

    client = HttpClient(Endpoint.parse(url))
    try:
        model = await check_server(client, None)
        sender = Sender(client, api="completions", model=model, timeout=120)
        runner = LoadRunner(send=sender.send, budget=Budget(None), rate=rate, seed=seed)
        runner.budget.deadline = time.perf_counter() + duration
        return await runner.run(workload(rate, duration, seed), open_loop=True)
    finally:
        await client.aclose()


def figures(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.ttft is not None]
    ttft = sorted(r.ttft for r in ok if r.ttft is not None)
    itl = sorted(x for r in ok for x in r.itl)
    good = [
        r
        for r in ok
        if r.ttft is not None
        and r.ttft <= SLO_TTFT_S
        and (not r.itl or sum(r.itl) / len(r.itl) <= SLO_ITL_S)
    ]
    long_ttft = sorted(r.ttft for r in ok if r.ttft and r.expected_prompt_tokens >= 4000)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_p50_ms": percentile(ttft, 50) * 1000 if ttft else None,
        "ttft_p99_ms": percentile(ttft, 99) * 1000 if ttft else None,
        "long_ttft_p50_ms": percentile(long_ttft, 50) * 1000 if long_ttft else None,
        "itl_p50_ms": percentile(itl, 50) * 1000 if itl else None,
        "itl_p99_ms": percentile(itl, 99) * 1000 if itl else None,
        "goodput_rps": len(good) / duration,
        "goodput_fraction": len(good) / len(records) if records else 0.0,
    }


def one_stack(
    name: str, flags: list[str], rate: float, duration: float, seed: int
) -> dict[str, Any]:
    from dynamo.bench.__main__ import run_loop

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dynamo-disagg-bench-") as tmp:
        env = service_env(TMPDIR=tmp)
        serve = Child(
            f"serve-{name}",
            ["-m", "dynamo.serve", "--http-host", "127.0.0.1", "--http-port", str(port)]
            + ["--router-mode", "kv", *flags, *MOCKER],
            env,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_model(url)
            records = run_loop(load(url, rate, duration, seed))
        finally:
            serve.stop()
    return figures(records, duration)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=12.0, help="arrivals per second")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=str(REPO / "bench-results" / "disagg.json"))
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for name, flags in STACKS.items():
        results[name] = one_stack(name, flags, args.rate, args.duration, args.seed)
        r = results[name]
        print(
            f"{name:>20}: TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms,"
            f" ITL p50 {r['itl_p50_ms']:.1f} ms p99 {r['itl_p99_ms']:.1f} ms,"
            f" goodput {r['goodput_rps']:.2f} req/s ({r['goodput_fraction']:.0%}),"
            f" errors {r['errors']}/{r['requests']}",
            flush=True,
        )
    agg = results["agg 4"]
    cuts: dict[str, float] = {}
    met = True
    for mode in ("route", "queue"):
        dis = results[f"disagg 2P+2D {mode}"]
        cuts[mode] = cut = 1 - dis["itl_p99_ms"] / agg["itl_p99_ms"]
        ok = cut >= 0.5 and dis["goodput_rps"] >= agg["goodput_rps"]
        met = met and ok
        verdict = "met" if ok else "missed"
        print(f"{mode}: ITL p99 cut {cut:.0%}; goal (>= 50 %, goodput >= agg): {verdict}")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    out = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "commit": commit,
        "rate": args.rate,
        "duration_s": args.duration,
        "results": results,
        "itl_p99_cut": cuts,
        "goal_met": met,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stack benchmark (issue 4): the frontend and one mocker at speedup 0, each in its own process
with file discovery in a temporary directory, loaded by ``dynamo bench`` (a library call in
this process) with ISL 128 / OSL 64 chat requests at concurrency 1, 16, 64 and 256.

Per level: req/s, TTFT p50/p99, and the CPU milliseconds per request of the frontend and of
the mocker (``/proc``, all threads), plus the bench client's own CPU per request (it shares the
machine, so it must stay small: its HTTP/SSE client is a lean asyncio protocol; httpx measured
~5.6 ms of client CPU per 64-chunk stream on the 2-core VM, the lean client ~0.4-0.6 ms).

    .venv/bin/python benchmarks/stack.py                      # full run
    .venv/bin/python benchmarks/stack.py --quick              # fewer requests
    .venv/bin/python benchmarks/stack.py --concurrency 1,64 --api completions

Reference on the 2-core VM: frontend 2.0-2.2 ms + mocker 1.4-1.6 ms of CPU per request at
saturation (~260 req/s), TTFT p50 4.2 ms at c=1. Goals: <= 2.8 ms CPU per request for both
together; TTFT p50 <= 4 ms at c=1 on a keep-alive connection.

Results: a table on stdout and JSON in ``bench-results/stack.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from dynamo.bench import BenchConfig, run_benchmark
from dynamo.bench.__main__ import run_loop

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "dynamo" / "models" / "demo"
GOAL_CPU_MS = 2.8
GOAL_TTFT_P50_MS = 4.0
# Measured requests per level (full run); warm-up is max(2 * c, 32) requests.
REQUESTS = {1: 300, 16: 1000, 64: 1500, 256: 2000}


class Child:
    """A service process whose output lines are collected (and echoed on failure)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not print {prefix!r}:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)


def wait_model(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                if json.loads(response.read())["data"]:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the model did not appear in /v1/models")


def run_level(
    url: str, c: int, requests: int, args: argparse.Namespace, pids: dict[str, int]
) -> dict[str, Any]:
    config = BenchConfig(
        url=url,
        api=args.api,
        isl=args.isl,
        osl=args.osl,
        concurrency=c,
        num_requests=requests,
        warmup=max(2 * c, 32),
        seed=1000 + c,  # distinct prompts per level: no prefix-cache hits across levels
        server_pids=list(pids.values()),
        progress=sys.stderr.isatty(),
        plots=False,
        output_dir=str(Path(args.out).parent / "stack" / f"c{c}") if args.reports else None,
    )
    summary = run_loop(run_benchmark(config)).summary
    done = summary["requests"]["completed"]
    per_pid = summary["server_cpu"]["per_pid_s"]
    cpu = {name: per_pid[str(pid)] * 1000 / max(done, 1) for name, pid in pids.items()}
    return {
        "concurrency": c,
        "requests": summary["requests"],
        "req_per_s": summary["request_throughput_rps"],
        "output_tok_per_s": summary["output_token_throughput_tps"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "e2e_p50_ms": summary["e2e_latency_ms"]["p50"],
        "frontend_cpu_ms_per_req": cpu["frontend"],
        "mocker_cpu_ms_per_req": cpu["mocker"],
        "stack_cpu_ms_per_req": cpu["frontend"] + cpu["mocker"],
        "client_cpu_ms_per_req": summary["client_cpu"]["cpu_ms_per_request"],
        "errors": summary["errors"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated levels")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--api", choices=("chat", "completions"), default="chat")
    parser.add_argument("--quick", action="store_true", help="a fifth of the requests")
    parser.add_argument("--reports", action="store_true", help="also write bench report folders")
    parser.add_argument("--out", default="bench-results/stack.json")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    with tempfile.TemporaryDirectory(prefix="dynamo-stack-bench-") as discovery:
        env = dict(os.environ, DYN_FILE_KV=discovery, PYTHONUNBUFFERED="1")
        mocker = Child(
            "mocker",
            ["-m", "dynamo.mocker", "--model-path", str(MODEL), "--model-name", "demo"]
            + ["--speedup-ratio", "0"],
            env,
        )
        frontend = Child(
            "frontend",
            ["-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", "0"],
            env,
        )
        try:
            line = frontend.wait_line("dynamo frontend: listening on http://", 60)
            url = "http://127.0.0.1:" + line.rsplit(":", 1)[1]
            wait_model(url)
            pids = {"frontend": frontend.proc.pid, "mocker": mocker.proc.pid}
            results = []
            for c in levels:
                count = REQUESTS.get(c, 1000)
                count = max(count // 5, 2 * c) if args.quick else count
                results.append(run_level(url, c, count, args, pids))
                print(_row(results[-1]), flush=True)
        finally:
            frontend.stop()
            mocker.stop()
    report = {
        "benchmark": "stack",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "isl": args.isl,
        "osl": args.osl,
        "api": args.api,
        "goals": {"stack_cpu_ms_per_req": GOAL_CPU_MS, "ttft_p50_ms_at_c1": GOAL_TTFT_P50_MS},
        "reference": {
            "frontend_cpu_ms": "2.0-2.2",
            "mocker_cpu_ms": "1.4-1.6",
            "req_per_s": 260,
            "ttft_p50_ms_at_c1": 4.2,
        },  # fmt: skip
        "levels": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table(results))
    print(f"\nwritten: {out}")
    return 0


HEADER = (
    f"{'c':>4} {'req/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'frontend':>9} {'mocker':>8} "
    f"{'stack':>7} {'client':>7} {'errors':>6}"
)


def _row(r: dict[str, Any]) -> str:
    return (
        f"{r['concurrency']:>4} {r['req_per_s']:>8.1f} {r['ttft_p50_ms']:>9.2f} "
        f"{r['ttft_p99_ms']:>9.2f} {r['frontend_cpu_ms_per_req']:>9.3f} "
        f"{r['mocker_cpu_ms_per_req']:>8.3f} {r['stack_cpu_ms_per_req']:>7.3f} "
        f"{r['client_cpu_ms_per_req']:>7.3f} {sum(r['errors'].values()):>6}"
    )


def table(results: list[dict[str, Any]]) -> str:
    lines = ["(TTFT in ms; CPU in ms per request)", HEADER]
    lines += [_row(r) for r in results]
    lines.append(
        f"goals: stack CPU <= {GOAL_CPU_MS} ms/request; TTFT p50 <= {GOAL_TTFT_P50_MS} ms at c=1"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

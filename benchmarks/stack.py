"""Stack benchmark (issue 4): the frontend and one mocker at speedup 0, each in its own process
with file discovery in a temporary directory, loaded by ``dynamo bench`` (a library call in
this process) with ISL 128 / OSL 64 chat requests at concurrency 1, 16, 64 and 256.

Per level: req/s, TTFT p50/p99, and the CPU milliseconds per request of the frontend and of
the mocker (``/proc``, all threads, children included: the frontend's tokenizer process), plus
the bench client's own CPU per request (it shares the machine, so it must stay small: its
HTTP/SSE client is a lean asyncio protocol; httpx measured ~5.6 ms of client CPU per 64-chunk
stream on the 2-core VM, the lean client ~0.4-0.6 ms).
Column ``(loop)``: the part of the frontend's CPU spent on its main thread, ours the event loop
that caps one frontend process at one core (the reference's HTTP runs on Rust threads: ~0).

    .venv/bin/python benchmarks/stack.py                      # full run
    .venv/bin/python benchmarks/stack.py --quick              # fewer requests
    .venv/bin/python benchmarks/stack.py --concurrency 1,64 --api completions
    .venv/bin/python benchmarks/stack.py --concurrency 1,64 --rounds 2 \
        --reference-python /work/refvenv/bin/python           # side by side with the reference

``--reference-python`` also runs the reference's frontend and mocker (NVIDIA Dynamo, installed
in another venv: ``python -m dynamo.frontend`` / ``python -m dynamo.mocker`` with file
discovery, TCP request plane and ZMQ events, like ours) with the same load, the two stacks
alternating per round, and reports our TTFT p50 at c=1 and rate at c=64 as ratios of its own.
Both mockers then run at ``--speedup-ratio 1000`` (the reference needs a positive speedup).

Reference on the 2-core VM: frontend 2.0-2.2 ms + mocker 1.4-1.6 ms of CPU per request at
saturation (~260 req/s), TTFT p50 4.2 ms at c=1. Goals: <= 2.8 ms CPU per request for both
together; TTFT p50 <= 4 ms at c=1 on a keep-alive connection.

``--tracing off,local,export`` (issue 17) runs our stack once per tracing mode: ``off``
(``OTEL_SDK_DISABLED=true``: no spans at all), ``local`` (the default: spans exist so log lines
carry trace ids, nothing exported) and ``export`` (``OTEL_EXPORT_ENABLED=1``, OTLP http/protobuf
to a receiver this script runs, ``tests/otlp_receiver.py``), and reports each mode's CPU per
request as a ratio of ``off``. Goals: local <= 1.05x, export <= 1.15x, frontend and worker.

Results: a table on stdout and JSON in ``bench-results/stack.json``.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

# As a script or as ``python -m benchmarks.stack`` (the command docs/performance.md records).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launcher import (  # noqa: E402
    MODEL,
    PLANES,
    REFERENCE_LOOPBACK,
    Child,
    OtlpReceiverProcess,
    free_port,
    isolate_network,
    service_env,
    tracing_env,
    wait_model,
)

from dynamo.bench import BenchConfig, run_benchmark  # noqa: E402
from dynamo.bench.__main__ import run_loop  # noqa: E402
from dynamo.bench.cpu import descendants, process_cpu_seconds  # noqa: E402

GOAL_CPU_MS = 2.8
GOAL_TTFT_P50_MS = 4.0
GOAL_TTFT_RATIO_C1 = 0.8  # side by side: our TTFT p50 at c=1 over the reference's, at most
GOAL_RATE_RATIO_C64 = 2.0  # side by side: our req/s at c=64 over the reference's, at least
GOAL_TRACING = {"local": 1.05, "export": 1.15}  # CPU per request over tracing off, at most
# Measured requests per level (full run); warm-up is max(2 * c, 32) requests.
REQUESTS = {1: 300, 16: 1000, 64: 1500, 256: 2000}


def run_level(
    url: str, c: int, requests: int, args: argparse.Namespace, pids: dict[str, int]
) -> dict[str, Any]:
    config = BenchConfig(
        url=url,
        api=args.api,
        isl=args.isl,
        osl=args.osl,
        concurrency=c,
        # top-level ignore_eos only: the reference refuses an unknown nvext field
        ignore_eos=False,
        extra_body={"ignore_eos": True},
        quickack=True,  # no delayed-ACK artifacts in the latencies (either server)
        num_requests=requests,
        warmup=max(2 * c, 32),
        seed=1000 + c,  # distinct prompts per level: no prefix-cache hits across levels
        server_pids=list(pids.values()),
        progress=sys.stderr.isatty(),
        plots=False,
        output_dir=str(Path(args.out).parent / "stack" / f"c{c}") if args.reports else None,
    )
    frontend = pids["frontend"]
    main_before, all_before = _main_thread_cpu(frontend), _tree_cpu(frontend)
    summary = run_loop(run_benchmark(config)).summary
    main_used = _main_thread_cpu(frontend) - main_before
    all_used = _tree_cpu(frontend) - all_before
    done = summary["requests"]["completed"]
    per_pid = summary["server_cpu"]["per_pid_s"]
    cpu = {name: per_pid[str(pid)] * 1000 / max(done, 1) for name, pid in pids.items()}
    # The event loop's thread caps one frontend process at one core: its share of the frontend's
    # CPU (warm-up included, as a ratio) times the measured CPU per request. The frontend's CPU
    # (``server_cpu``) includes its children's, the tokenizer process's among them.
    loop_share = main_used / all_used if all_used > 0 else 0.0
    return {
        "concurrency": c,
        "requests": summary["requests"],
        "req_per_s": summary["request_throughput_rps"],
        "output_tok_per_s": summary["output_token_throughput_tps"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "e2e_p50_ms": summary["e2e_latency_ms"]["p50"],
        "frontend_cpu_ms_per_req": cpu["frontend"],
        "frontend_loop_cpu_ms_per_req": cpu["frontend"] * loop_share,
        "mocker_cpu_ms_per_req": cpu["mocker"],
        "stack_cpu_ms_per_req": cpu["frontend"] + cpu["mocker"],
        "client_cpu_ms_per_req": summary["client_cpu"]["cpu_ms_per_request"],
        "errors": summary["errors"],
    }


def _tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children (a child born later counts from 0)."""
    return sum(process_cpu_seconds(p) or 0.0 for p in {pid} | descendants(pid))


def _main_thread_cpu(pid: int) -> float:
    """CPU seconds of ``pid``'s main thread (the frontend's event loop) alone."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stack:
    """A frontend and one mocker, ours or the reference's (``python``), on a fresh discovery
    directory."""

    def __init__(
        self, label: str, python: str, speedup: float, extra_env: dict[str, str] | None = None
    ) -> None:
        self.label = label
        self._dir = tempfile.TemporaryDirectory(prefix=f"dynamo-stack-{label}-")
        ours = python == sys.executable
        loopback = {} if ours else REFERENCE_LOOPBACK
        env = service_env(self._dir.name, **loopback, **(extra_env or {}))
        mocker_args = ["-m", "dynamo.mocker", "--model-path", str(MODEL), "--model-name", "demo"]
        mocker_args += ["--speedup-ratio", f"{speedup:g}"]
        port = 0 if ours else free_port()
        frontend_args = ["-m", "dynamo.frontend", "--http-host", "127.0.0.1"]
        frontend_args += ["--http-port", str(port)]
        if not ours:  # the reference's defaults are etcd and NATS
            mocker_args += PLANES
            frontend_args += PLANES
        self.mocker = Child(f"{label} mocker", mocker_args, env, python)
        self.frontend = Child(f"{label} frontend", frontend_args, env, python)
        try:
            if ours:
                port = self.frontend.port()
            self.url = f"http://127.0.0.1:{port}"
            wait_model(self.url, 120)
        except Exception:
            for child in (self.frontend, self.mocker):
                print(child.tail(), file=sys.stderr)
            self.stop()
            raise
        self.pids = {"frontend": self.frontend.pid, "mocker": self.mocker.pid}

    def stop(self) -> None:
        self.frontend.stop()
        self.mocker.stop()
        self._dir.cleanup()


def run_rounds(
    args: argparse.Namespace,
    levels: list[int],
    stacks: list[tuple[str, Callable[[], Stack]]],
    width: int,
) -> dict[str, list[list[dict[str, Any]]]]:
    """``args.rounds`` rounds of every stack (started anew for each, in turn), each driven at
    every concurrency level: per label, per round, per level, the figures of :func:`run_level`
    (printed as they come, the label right-aligned to ``width``)."""
    runs: dict[str, list[list[dict[str, Any]]]] = {label: [] for label, _ in stacks}
    for round_ in range(args.rounds):
        for label, start in stacks:
            stack = start()
            try:
                results = []
                for c in levels:
                    count = REQUESTS.get(c, 1000)
                    count = max(count // 5, 2 * c) if args.quick else count
                    results.append(run_level(stack.url, c, count, args, stack.pids))
                    print(f"{label:>{width}} r{round_ + 1} " + _row(results[-1]), flush=True)
                runs[label].append(results)
            finally:
                stack.stop()
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated levels")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--api", choices=("chat", "completions"), default="chat")
    parser.add_argument("--quick", action="store_true", help="a fifth of the requests")
    parser.add_argument("--reports", action="store_true", help="also write bench report folders")
    parser.add_argument("--reference-python", help="also run the reference stack (its Python)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every stack, alternating")
    parser.add_argument(
        "--speedup-ratio", type=float, help="mocker speedup (default 0; 1000 with a reference)"
    )
    parser.add_argument(
        "--tracing", help="compare tracing modes (comma-separated: off, local, export)"
    )
    parser.add_argument("--out", default="bench-results/stack.json")
    args = parser.parse_args(argv)
    if args.reference_python:
        isolate_network()
    if args.tracing:
        return tracing_modes(args)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    speedup = args.speedup_ratio
    if speedup is None:
        speedup = 1000.0 if args.reference_python else 0.0
    targets = [("dynamo-py", sys.executable)]
    if args.reference_python:
        targets.append(("reference", args.reference_python))
    stacks = [
        (label, lambda label=label, python=python: Stack(label, python, speedup))
        for label, python in targets
    ]
    runs = run_rounds(args, levels, stacks, width=10)
    report: dict[str, Any] = {
        "benchmark": "stack",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "isl": args.isl,
        "osl": args.osl,
        "api": args.api,
        "speedup_ratio": speedup,
        "goals": {
            "stack_cpu_ms_per_req": GOAL_CPU_MS,
            "ttft_p50_ms_at_c1": GOAL_TTFT_P50_MS,
            "ttft_p50_c1_vs_reference_at_most": GOAL_TTFT_RATIO_C1,
            "req_per_s_c64_vs_reference_at_least": GOAL_RATE_RATIO_C64,
        },
        "levels": runs["dynamo-py"][-1],
        "runs": runs,
    }
    if args.reference_python:
        report["side_by_side"] = side_by_side(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for label, _ in targets:
        print(f"\n{label} (last round)")
        print(table(runs[label][-1]))
    if "side_by_side" in report:
        print()
        for key, value in report["side_by_side"].items():
            print(f"{key}: {value}")
    print(f"\nwritten: {out}")
    return 0


def tracing_modes(args: argparse.Namespace) -> int:
    """Our stack once per tracing mode and round (modes alternating), CPU per request compared
    with ``off``: medians over the rounds, and medians of each round's ratio (paired rounds
    cancel some of a shared machine's drift). The OTLP receiver runs in a process of its own:
    in this one it would slow the load generator down, and the stack with it."""
    modes = [m.strip() for m in args.tracing.split(",") if m.strip()]
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    speedup = args.speedup_ratio or 0.0
    with OtlpReceiverProcess() as receiver:
        endpoint = receiver.endpoint

        def traced(mode: str) -> Callable[[], Stack]:
            return lambda: Stack(mode, sys.executable, speedup, tracing_env(mode, endpoint))

        stacks = [(mode, traced(mode)) for mode in modes]
        runs = run_rounds(args, levels, stacks, width=7)
        spans = receiver.spans()
    compared: dict[str, Any] = {}
    for c in levels:
        base = {k: _median_of(runs["off"], c, k) for k in CPU_KEYS} if "off" in runs else {}
        for mode in modes:
            row = {k: _median_of(runs[mode], c, k) for k in CPU_KEYS}
            if base and mode != "off":
                row |= {f"{k}_vs_off": (row[k] or 0) / (base[k] or 1) for k in CPU_KEYS}
                row |= {
                    f"{k}_vs_off_paired": _paired_ratio(runs[mode], runs["off"], c, k)
                    for k in CPU_KEYS
                }
            compared[f"c{c}/{mode}"] = row
    report = {
        "benchmark": "stack --tracing",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "load_average": os.getloadavg(),
        "spans_received_by_the_otlp_receiver": spans,
        "goals_vs_off": GOAL_TRACING,
        "medians": compared,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for key, row in compared.items():
        print(key, {k: round(v, 3) for k, v in row.items() if v is not None})
    print(f"spans received: {spans}; load average {os.getloadavg()}; written: {out}")
    return 0


def _paired_ratio(
    runs: list[list[dict[str, Any]]], base: list[list[dict[str, Any]]], c: int, key: str
) -> float | None:
    """The median over rounds of (this round's value / the same round's ``off`` value)."""
    ratios = []
    for mine, theirs in zip(runs, base, strict=False):
        a = [r[key] for r in mine if r["concurrency"] == c]
        b = [r[key] for r in theirs if r["concurrency"] == c]
        if a and b and b[0]:
            ratios.append(a[0] / b[0])
    return statistics.median(ratios) if ratios else None


CPU_KEYS = (
    "frontend_cpu_ms_per_req",
    "frontend_loop_cpu_ms_per_req",
    "mocker_cpu_ms_per_req",
    "stack_cpu_ms_per_req",
)


def _median_of(runs: list[list[dict[str, Any]]], c: int, key: str) -> float | None:
    values = [r[key] for results in runs for r in results if r["concurrency"] == c]
    return statistics.median(values) if values else None


def side_by_side(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians over the rounds, and our figures as ratios of the reference's."""
    out: dict[str, Any] = {}
    for c, key in ((1, "ttft_p50_ms"), (64, "req_per_s")):
        ours = _median_of(runs["dynamo-py"], c, key)
        ref = _median_of(runs["reference"], c, key)
        if ours is None or ref is None:
            continue
        out[f"{key}_c{c}"] = {"dynamo-py": ours, "reference": ref, "ratio": ours / ref}
    return out


HEADER = (
    f"{'c':>4} {'req/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'frontend':>9} {'(loop)':>7} "
    f"{'mocker':>8} "
    f"{'stack':>7} {'client':>7} {'errors':>6}"
)


def _row(r: dict[str, Any]) -> str:
    return (
        f"{r['concurrency']:>4} {r['req_per_s']:>8.1f} {r['ttft_p50_ms']:>9.2f} "
        f"{r['ttft_p99_ms']:>9.2f} {r['frontend_cpu_ms_per_req']:>9.3f} "
        f"{r.get('frontend_loop_cpu_ms_per_req', 0.0):>7.3f} "
        f"{r['mocker_cpu_ms_per_req']:>8.3f} {r['stack_cpu_ms_per_req']:>7.3f} "
        f"{r['client_cpu_ms_per_req']:>7.3f} {sum(r['errors'].values()):>6}"
    )


def table(results: list[dict[str, Any]]) -> str:
    lines = ["(TTFT in ms; CPU in ms per request; (loop): the frontend's event-loop thread)"]
    lines.append(HEADER)
    lines += [_row(r) for r in results]
    lines.append(
        f"goals: stack CPU <= {GOAL_CPU_MS} ms/request; TTFT p50 <= {GOAL_TTFT_P50_MS} ms at c=1"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

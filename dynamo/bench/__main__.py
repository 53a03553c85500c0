"""``dynamo bench`` / ``python -m dynamo.bench``: the command line.

    dynamo bench [run] --url http://127.0.0.1:8000 --isl 128 --osl 64 --concurrency 16
    dynamo bench compare A B        (A, B: summary.json files or report folders)

Exit status: 0 done (even with failed requests, which the report counts), 2 bad input (a
one-line message on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec

from dynamo.bench.benchmark import BenchError, BenchResult, run_benchmark
from dynamo.bench.config import APIS, WORKLOADS, BenchConfig
from dynamo.bench.report import compare, format_compare, format_summary, load_summary

T = TypeVar("T")
PROG = "dynamo bench"


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags (what is sent), shared with ``dynamo replay``."""
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    w.add_argument("--isl", type=int, default=128, help="input tokens (per turn for multi-turn)")
    w.add_argument("--osl", type=int, default=64, help="output tokens (max_tokens + ignore_eos)")
    w.add_argument("--isl-stddev", type=float, default=0.0, help="normal spread of --isl")
    w.add_argument("--osl-stddev", type=float, default=0.0, help="normal spread of --osl")
    w.add_argument("--prefix-groups", type=int, default=4, help="prefix: number of groups G")
    w.add_argument("--prefix-len", type=int, default=256, help="prefix: shared tokens P")
    w.add_argument("--suffix-len", type=int, default=64, help="prefix: unique tokens S")
    w.add_argument("--turns", type=int, default=3, help="multi-turn: turns per session")
    w.add_argument("--think-time", type=float, default=0.0, help="multi-turn: s between turns")
    w.add_argument("--trace", help="trace: Mooncake JSONL file")
    w.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash id")
    w.add_argument("--trace-speedup", type=float, default=1.0, help="trace: time compression")


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The load flags (how it is offered), shared with ``dynamo replay``."""
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=1, help="closed loop: requests in flight")
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    load.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    load.add_argument("--num-requests", type=int, help="measured requests (default 100)")
    load.add_argument("--duration", type=float, help="seconds to keep starting requests")
    load.add_argument("--warmup", type=int, default=0, help="unmeasured requests first")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")


def workload_and_load(args: argparse.Namespace) -> dict[str, Any]:
    """The BenchConfig fields set by :func:`add_workload_arguments` and
    :func:`add_load_arguments`."""
    return {
        "workload": args.workload,
        "isl": args.isl,
        "osl": args.osl,
        "isl_stddev": args.isl_stddev,
        "osl_stddev": args.osl_stddev,
        "prefix_groups": args.prefix_groups,
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "turns": args.turns,
        "think_time_s": args.think_time,
        "trace": args.trace,
        "trace_block_size": args.trace_block_size,
        "trace_speedup": args.trace_speedup,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "max_concurrency": args.max_concurrency,
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "warmup": args.warmup,
        "seed": args.seed,
        "request_timeout_s": args.request_timeout,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        PROG,
        description="Load generator and benchmark reports for OpenAI-compatible endpoints. "
        "'dynamo bench compare A B' prints the ratio B/A of every figure of two runs.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", help="model name (default: the server's first model)")
    p.add_argument("--api", choices=APIS, default="chat", help="endpoint (default chat)")
    p.add_argument(
        "--tokenizer",
        help="model directory with tokenizer.json and chat template, for exact prompt lengths "
        "(default: the bundled demo model when the model is 'demo')",
    )
    p.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="completions prompts as token ids (exact, default) or text",
    )
    add_workload_arguments(p)
    add_load_arguments(p)
    req = p.add_argument_group("request")
    req.add_argument(
        "--no-ignore-eos", action="store_true", help="let the model stop before --osl tokens"
    )
    req.add_argument(
        "--quickack", action="store_true", help="TCP_QUICKACK on the client sockets (Linux)"
    )
    req.add_argument("--extra-body", default="{}", help="JSON object merged into every body")
    req.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token")
    out = p.add_argument_group("output")
    out.add_argument(
        "--server-pids",
        default="",
        help="comma-separated PIDs whose CPU time (with their "
        "child processes) is reported per request, read from /proc",
    )
    out.add_argument("--output-dir", help="report folder: summary.json, requests.jsonl, plots/")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--json", action="store_true", help="print the summary as JSON")
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A BenchConfig from parsed arguments; ValueError for malformed values."""
    try:
        extra = msgspec.json.decode(args.extra_body)
    except msgspec.DecodeError:
        raise ValueError("--extra-body must be a JSON object") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    try:
        pids = [int(p) for p in args.server_pids.split(",") if p.strip()]
    except ValueError:
        raise ValueError("--server-pids must be comma-separated integers") from None
    return BenchConfig(
        url=args.url,
        model=args.model,
        api=args.api,
        tokenizer=args.tokenizer,
        prompt_format=args.prompt_format,
        **workload_and_load(args),
        ignore_eos=not args.no_ignore_eos,
        extra_body=extra,
        api_key=args.api_key,
        server_pids=pids,
        output_dir=args.output_dir,
        plots=not args.no_plots,
        progress=args.progress,
        quickack=args.quickack,
    )


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop (a core dependency; its loop costs the client less CPU per chunk)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def _error(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def _compare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(f"{PROG} compare", description="ratio B/A of every figure")
    parser.add_argument("a", help="summary.json or report folder (baseline)")
    parser.add_argument("b", help="summary.json or report folder")
    args = parser.parse_args(argv)
    try:
        a, b = load_summary(args.a), load_summary(args.b)
    except ValueError as exc:
        return _error(str(exc))
    print(format_compare(compare(a, b), args.a, args.b))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "compare":
        return _compare(args[1:])
    if args and args[0] == "run":
        args = args[1:]
    parsed = build_parser().parse_args(args)
    try:
        config = config_from_args(parsed)
        result: BenchResult = run_loop(run_benchmark(config))
    except (BenchError, ValueError) as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    if parsed.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result.summary)).decode() + "\n")
    else:
        print(format_summary(result.summary))
        if config.output_dir:
            print(f"report: {config.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``dynamo replay``: simulate a deployment offline on a virtual clock.

    dynamo replay --workers 4 --router-mode kv --block-size 16 --num-gpu-blocks-override 512 \\
        --workload prefix --prefix-groups 16 --prefix-len 1024 --suffix-len 128 --osl 32 \\
        --concurrency 32 --num-requests 320 --output-dir out/

Flags: ``dynamo bench``'s workload and load flags (unchanged), ``dynamo serve``'s deployment
flags (``--workers``, ``--router-mode``, the KV router's flags), the mocker's engine flags, plus
``--prefill-workers``/``--decode-workers`` (disaggregated xPyD, with the frontend's
conditional-disaggregation flags). Writes ``dynamo bench``'s report to
``--output-dir`` (and ``routing.jsonl`` with ``--routing-records``).

Exit status: 0 done, 2 bad input (a one-line message on stderr).
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from dynamo.bench.__main__ import add_load_arguments, add_workload_arguments, workload_and_load
from dynamo.bench.config import BenchConfig
from dynamo.bench.report import format_summary
from dynamo.bench.trace import TraceError
from dynamo.frontend.config import ROUTER_MODES
from dynamo.frontend.disagg import DisaggSettings
from dynamo.mocker.config import MockerConfig
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import ReplayResult, run_replay
from dynamo.router.config import KVRouterSettings
from dynamo.runtime.config import add_flag
from dynamo.runtime.heap import settle_after_start

PROG = "dynamo replay"


def add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    """``dynamo serve``'s deployment flags, the KV router's flags and the mocker's flags."""
    g = parser.add_argument_group("deployment")
    add_flag(g, "--workers", default=2, type=int, help="workers (decode workers when disagg)")
    add_flag(
        g,
        "--prefill-workers",
        default=0,
        type=int,
        help="prefill workers: > 0 simulates disaggregated serving (xPyD)",
    )
    add_flag(
        g,
        "--decode-workers",
        default=0,
        type=int,
        help="disaggregated: decode workers (default --workers)",
    )
    add_flag(
        g,
        "--router-mode",
        default="round-robin",
        choices=ROUTER_MODES,
        help="how the frontend picks a worker",
    )
    add_flag(
        g,
        "--frontend-ms",
        default=0.0,
        type=float,
        help="the frontend's own time a request in ms: the router sees requests one after "
        "another at this pace (0: at once)",
    )
    KVRouterSettings.add_arguments(parser)
    DisaggSettings.add_arguments(parser)
    MockerConfig.add_arguments(parser)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``dynamo bench``'s workload and load flags, and its tokenizer."""
    parser.add_argument(
        "--tokenizer",
        help="model directory whose tokenizer builds the prompts (default: --model-path, "
        "else the bundled demo model)",
    )
    add_workload_arguments(parser)
    add_load_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        PROG,
        description="Simulate a deployment (the live router code and the mocker scheduler) "
        "on a virtual clock and write dynamo bench's report.",
    )
    add_bench_arguments(p)
    add_deployment_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", help="report folder: summary.json, requests.jsonl, plots/")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument(
        "--routing-records",
        action="store_true",
        help="also write routing.jsonl: each request's worker, overlap and cost",
    )
    out.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The workload and load of a replay (ValueError for bad values)."""
    config = BenchConfig(
        url="replay:",
        api="completions",
        tokenizer=args.tokenizer or args.model_path,
        **workload_and_load(args),
    )
    config.validate()
    return config


def deployment(args: argparse.Namespace) -> Deployment:
    """The simulated deployment from the flags (ValueError for bad values)."""
    decode = args.decode_workers if args.prefill_workers > 0 and args.decode_workers else None
    return Deployment(
        workers=decode or args.workers,
        prefill_workers=args.prefill_workers,
        disagg=DisaggSettings.from_args(args),
        router_mode=args.router_mode,
        kv=KVRouterSettings.from_args(args),
        engine=MockerConfig.from_args(args),
        frontend_ms=args.frontend_ms,
    )


def _error(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: ReplayResult = run_replay(
            bench_config(args),
            deployment(args),
            output_dir=args.output_dir,
            plots=not args.no_plots,
            routing_records=args.routing_records,
        )
    except (ValueError, TraceError) as exc:
        return _error(str(exc))
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result.summary)).decode() + "\n")
    else:
        replay = result.summary["replay"]
        print(format_summary(result.summary))
        print(
            f"simulated {replay['simulated_s']:.2f} s in {replay['wall_s']:.2f} s wall "
            f"({replay['passes']} forward passes)"
        )
        if args.output_dir:
            print(f"report: {args.output_dir}")
    return 0


if __name__ == "__main__":
    settle_after_start()  # the process's collector, as ``dynamo.cli`` sets it for this command
    sys.exit(main())

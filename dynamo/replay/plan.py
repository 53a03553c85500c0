"""``dynamo plan``: the cheapest deployments that meet a latency SLO, found by replaying one
workload against a sweep of deployments (worker counts, prefill/decode splits, router modes and
KV router weights).

    dynamo plan --workload prefix --prefix-groups 16 --prefix-len 1024 --suffix-len 128 \\
        --osl 32 --rate 20 --num-requests 400 --block-size 16 --num-gpu-blocks-override 512 \\
        --slo-ttft-ms 200 --slo-itl-ms 40 --sweep-workers 1,2,4,8 \\
        --sweep-router-modes kv,round-robin

Cost is the number of engines (workers + prefill workers: GPUs, in a real deployment); ties go
to the lower latency. Every other flag is ``dynamo replay``'s and sets the base deployment that
the sweep varies. Writes ``plan.json`` and ``frontier.png`` (the cheapest SLO-meeting latency at
each cost) to ``--output-dir``. Exit status: 0 when some configuration meets the SLO, 1 when none
does, 2 for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from dynamo.bench.config import BenchConfig
from dynamo.bench.trace import TraceError
from dynamo.replay.__main__ import add_bench_arguments, add_deployment_arguments, bench_config
from dynamo.replay.__main__ import deployment as base_deployment
from dynamo.replay.deployment import ROUTER_MODES, Deployment
from dynamo.replay.run import run_replay
from dynamo.runtime.config import add_flag
from dynamo.runtime.heap import settle_after_start

PROG = "dynamo plan"
PERCENTILES = ("p50", "p90", "p99", "mean", "max")
PLAN_FILE = "plan.json"


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets: a percentile of TTFT and of ITL (ms); None: not constrained.
    ``headroom`` (a fraction) is kept free for what the replay does not model (the frontend,
    the transport, a busy host): a replay meets the SLO at ``target * (1 - headroom)``."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    ttft_percentile: str = "p90"
    itl_percentile: str = "p90"
    headroom: float = 0.0

    def __post_init__(self) -> None:
        for name in (self.ttft_percentile, self.itl_percentile):
            if name not in PERCENTILES:
                raise ValueError(f"SLO percentiles must be one of {', '.join(PERCENTILES)}")
        for value in (self.ttft_ms, self.itl_ms):
            if value is not None and not value > 0:
                raise ValueError("SLO targets must be > 0 ms")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError("--slo-headroom must be in [0, 1)")

    def meets(self, ttft_ms: float | None, itl_ms: float | None) -> bool:
        keep = 1.0 - self.headroom
        if self.ttft_ms is not None and (ttft_ms is None or ttft_ms > self.ttft_ms * keep):
            return False
        return self.itl_ms is None or itl_ms is None or itl_ms <= self.itl_ms * keep


@dataclass(frozen=True, slots=True)
class Sweep:
    """The deployments to try: the product of these lists, on top of a base deployment."""

    workers: tuple[int, ...] = (1, 2, 4)
    prefill_workers: tuple[int, ...] = (0,)
    router_modes: tuple[str, ...] = ("kv",)
    overlap_weights: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if not self.workers or min(self.workers) < 1:
            raise ValueError("--sweep-workers needs counts >= 1")
        if not self.prefill_workers or min(self.prefill_workers) < 0:
            raise ValueError("--sweep-prefill-workers needs counts >= 0")
        if not self.router_modes or set(self.router_modes) - set(ROUTER_MODES):
            raise ValueError(f"--sweep-router-modes takes {', '.join(ROUTER_MODES)}")
        if not self.overlap_weights or min(self.overlap_weights) < 0:
            raise ValueError("--sweep-overlap-weights needs weights >= 0")

    def deployments(self, base: Deployment) -> list[Deployment]:
        out: list[Deployment] = []
        for workers, prefill, mode in itertools.product(
            self.workers, self.prefill_workers, self.router_modes
        ):
            weights = self.overlap_weights if mode == "kv" else (base.kv.overlap_score_weight,)
            for weight in weights:
                kv = dataclasses.replace(base.kv, overlap_score_weight=weight)
                out.append(
                    dataclasses.replace(
                        base, workers=workers, prefill_workers=prefill, router_mode=mode, kv=kv
                    )
                )
        return out


@dataclass(slots=True)
class Outcome:
    """One replayed deployment and how it did against the SLO."""

    deployment: Deployment
    ttft_ms: float | None
    itl_ms: float | None
    throughput_rps: float
    failed: int
    meets_slo: bool

    @property
    def cost(self) -> int:
        return self.deployment.num_engines

    def describe(self) -> dict[str, Any]:
        return {
            "cost_engines": self.cost,
            "deployment": self.deployment.describe(),
            "ttft_ms": self.ttft_ms,
            "itl_ms": self.itl_ms,
            "request_throughput_rps": self.throughput_rps,
            "failed": self.failed,
            "meets_slo": self.meets_slo,
        }


@dataclass(slots=True)
class PlanResult:
    slo: SLO
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def feasible(self) -> list[Outcome]:
        """SLO-meeting outcomes, cheapest first (ties: lower TTFT, then ITL, then sweep order)."""
        ok = [o for o in self.outcomes if o.meets_slo]
        return sorted(ok, key=lambda o: (o.cost, o.ttft_ms or 0.0, o.itl_ms or 0.0))

    @property
    def best(self) -> Outcome | None:
        feasible = self.feasible
        return feasible[0] if feasible else None

    def frontier(self) -> list[Outcome]:
        """Per cost, the outcome with the lowest TTFT percentile (met or not)."""
        best: dict[int, Outcome] = {}
        for o in self.outcomes:
            cur = best.get(o.cost)
            if cur is None or (o.ttft_ms or 0.0) < (cur.ttft_ms or 0.0):
                best[o.cost] = o
        return [best[c] for c in sorted(best)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "slo": dataclasses.asdict(self.slo),
            "best": None if self.best is None else self.best.describe(),
            "feasible": [o.describe() for o in self.feasible],
            "outcomes": [o.describe() for o in self.outcomes],
        }


def plan(
    bench: BenchConfig,
    base: Deployment,
    slo: SLO,
    sweep: Sweep,
    *,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> PlanResult:
    """Replay ``bench`` against every deployment of ``sweep`` and judge each against ``slo``.
    A configuration with failed requests never meets the SLO."""
    result = PlanResult(slo)
    for deployment in sweep.deployments(base):
        summary = run_replay(bench, deployment).summary
        ttft = summary["ttft_ms"][slo.ttft_percentile]
        itl = summary["itl_ms"][slo.itl_percentile]
        failed = int(summary["requests"]["failed"])
        meets = failed == 0 and slo.meets(ttft, itl)
        outcome = Outcome(
            deployment, ttft, itl, float(summary["request_throughput_rps"]), failed, meets
        )
        result.outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return result


def write_plan(directory: str | Path, result: PlanResult, *, plots: bool = True) -> list[Path]:
    """plan.json and (``plots``) frontier.png: latency against cost, with the SLO lines."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / PLAN_FILE
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result.to_dict()), indent=2) + b"\n")
    written = [path]
    if plots:
        from dynamo.bench.plots import _pyplot

        plt = _pyplot()
        slo = result.slo
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for ax, key, target, pct in (
            (left, "ttft_ms", slo.ttft_ms, slo.ttft_percentile),
            (right, "itl_ms", slo.itl_ms, slo.itl_percentile),
        ):
            for meets, colour in ((True, "tab:green"), (False, "tab:red")):
                pts = [
                    (o.cost, getattr(o, key))
                    for o in result.outcomes
                    if o.meets_slo is meets and getattr(o, key) is not None
                ]
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=colour, s=16)
            front = [(o.cost, getattr(o, key)) for o in result.frontier()]
            ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:blue", label="best")
            if target is not None:
                ax.axhline(target, color="gray", linestyle="--", label="SLO")
            ax.set(xlabel="engines (workers + prefill workers)", ylabel=f"{key} {pct}")
            ax.legend(loc="upper right")
        left.set_title("TTFT against cost (green: meets the SLO)")
        right.set_title("ITL against cost")
        fig.tight_layout()
        png = out / "frontier.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        written.append(png)
    return written


def _list(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list: {text!r}") from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        PROG,
        description="Sweep deployments with the offline replay and report the cheapest ones "
        "meeting a TTFT/ITL SLO.",
    )
    add_bench_arguments(p)
    add_deployment_arguments(p)
    s = p.add_argument_group("SLO")
    add_flag(s, "--slo-ttft-ms", default=None, type=float, help="TTFT target (ms)")
    add_flag(s, "--slo-ttft-percentile", default="p90", choices=PERCENTILES, help="of TTFT")
    add_flag(s, "--slo-itl-ms", default=None, type=float, help="ITL target (ms)")
    add_flag(s, "--slo-itl-percentile", default="p90", choices=PERCENTILES, help="of ITL")
    add_flag(
        s,
        "--slo-headroom",
        default=0.0,
        type=float,
        help="fraction of each target kept free for what the replay does not model",
    )
    w = p.add_argument_group("sweep")
    add_flag(w, "--sweep-workers", default=(1, 2, 4), type=_list(int), help="worker counts")
    add_flag(
        w,
        "--sweep-prefill-workers",
        default=(0,),
        type=_list(int),
        help="prefill worker counts (0: aggregated)",
    )
    add_flag(
        w, "--sweep-router-modes", default=("kv",), type=_list(str), help="router modes to try"
    )
    add_flag(
        w,
        "--sweep-overlap-weights",
        default=(1.0,),
        type=_list(float),
        help="KV router prefill weights (--kv-overlap-score-weight) to try",
    )
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", help="folder for plan.json and frontier.png")
    out.add_argument("--no-plots", action="store_true", help="skip frontier.png")
    out.add_argument("--top", type=int, default=5, help="feasible configurations to print")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _row(o: Outcome) -> str:
    d = o.deployment
    split = f"{d.prefill_workers}P{d.workers}D" if d.disaggregated else f"{d.workers} workers"
    mode = d.router_mode + (
        f" (weight {d.kv.overlap_score_weight:g})" if d.router_mode == "kv" else ""
    )
    ttft = "-" if o.ttft_ms is None else f"{o.ttft_ms:.1f}"
    itl = "-" if o.itl_ms is None else f"{o.itl_ms:.1f}"
    return f"{o.cost:>3} engines  {split:<12} {mode:<22} ttft {ttft:>8}  itl {itl:>7}  " + (
        "meets" if o.meets_slo else "misses"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        slo = SLO(
            args.slo_ttft_ms,
            args.slo_itl_ms,
            args.slo_ttft_percentile,
            args.slo_itl_percentile,
            args.slo_headroom,
        )
        if slo.ttft_ms is None and slo.itl_ms is None:
            raise ValueError("give an SLO: --slo-ttft-ms and/or --slo-itl-ms")
        sweep = Sweep(
            args.sweep_workers,
            args.sweep_prefill_workers,
            args.sweep_router_modes,
            args.sweep_overlap_weights,
        )
        show = None if args.json else (lambda o: print(_row(o), flush=True))
        result = plan(bench_config(args), base_deployment(args), slo, sweep, on_outcome=show)
        if args.output_dir:
            write_plan(args.output_dir, result, plots=not args.no_plots)
    except (ValueError, TraceError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result.to_dict())).decode() + "\n")
    else:
        feasible = result.feasible
        print(f"\n{len(feasible)} of {len(result.outcomes)} configurations meet the SLO")
        for o in feasible[: args.top]:
            print("  " + _row(o))
    return 0 if result.best is not None else 1


if __name__ == "__main__":
    settle_after_start()  # the process's collector, as ``dynamo.cli`` sets it for this command
    sys.exit(main())

"""What the replay adds to ``dynamo bench``'s report: per-worker figures, the routing decision
of each request (``routing.jsonl``) and per-worker plots (load and prefix hit rate over time)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dynamo import native
from dynamo.bench.request import RequestRecord
from dynamo.replay import _report_fallback
from dynamo.replay._report_fallback import WorkerTotals
from dynamo.replay.flight import Flight

PLOT_BINS = 50

_impl = native.load(
    "dynamo.replay._report", "dynamo.replay._report_fallback", requires=("flight_figures",)
)
REPORT_IMPLEMENTATION: str = _impl.__name__
"""The module computing :func:`flight_figures` (``dynamo.replay._report`` or its fallback)."""


def _worker_key(worker_id: int, dp_rank: int) -> str:
    return f"{worker_id:x}:{dp_rank}"


def flight_figures(flights: Sequence[Flight]) -> tuple[list[RequestRecord], float, WorkerTotals]:
    """What the report reads of the flights, in one pass: their records in order, the last
    end among them (the measured window) and each worker's totals (:func:`worker_rows`)."""
    rows = flights if type(flights) is list else list(flights)
    figures: tuple[list[RequestRecord], float, WorkerTotals] | None = _impl.flight_figures(rows)
    if figures is None:  # the native module defers (an odd flight or value): the definition
        figures = _report_fallback.flight_figures(rows)
    return figures


def worker_rows(totals: WorkerTotals) -> dict[str, dict[str, Any]]:
    """Per ``worker:dp_rank`` (hex id, in that text's order): requests served, prompt and
    cached tokens, hit rate."""
    out: dict[str, dict[str, Any]] = {}
    for (worker_id, dp_rank), (requests, prompt, cached) in totals.items():
        out[_worker_key(worker_id, dp_rank)] = {
            "requests": requests,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0,
        }
    return dict(sorted(out.items()))


def worker_summary(flights: Sequence[Flight]) -> dict[str, dict[str, Any]]:
    """Per ``worker:dp_rank`` (hex id): requests served, prompt and cached tokens, hit rate, of
    the routed requests that completed."""
    return worker_rows(flight_figures(flights)[2])


def routing_rows(flights: Sequence[Flight]) -> Iterator[dict[str, Any]]:
    """One row per request, in send order: where it went, its predicted overlap and cost."""
    for f in flights:
        r = f.routing
        rec = f.record
        yield {
            "index": f.index,
            "start_ms": rec.start * 1000,
            "worker_id": None if r is None else r.worker_id,
            "dp_rank": None if r is None else r.dp_rank,
            "overlap_blocks": None if r is None else r.overlap_blocks,
            "cost": None if r is None else r.cost,
            "prefill_worker_id": None if r is None else r.prefill_worker_id,
            "prefill_dp_rank": None if r is None else r.prefill_dp_rank,
            "prefill_overlap_blocks": None if r is None else r.prefill_overlap_blocks,
            "prompt_tokens": rec.prompt_tokens,
            "cached_tokens": rec.cached_tokens,
            "error": rec.error,
        }


def write_worker_plots(directory: Path, flights: Sequence[Flight]) -> list[Path]:
    """workers.png: active requests per worker over time, and each worker's cumulative prefix
    hit rate (requests started so far). Needs matplotlib (``bench`` extra)."""
    from dynamo.bench.plots import _pyplot

    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    ok = [f for f in flights if f.routing is not None and f.record.ok]
    span = max((f.record.end for f in ok), default=0.0) or 1.0
    width = span / PLOT_BINS
    keys = sorted({_worker_key(f.routing.worker_id, f.routing.dp_rank) for f in ok if f.routing})
    active = {k: [0.0] * PLOT_BINS for k in keys}
    prompt = {k: [0] * PLOT_BINS for k in keys}
    cached = {k: [0] * PLOT_BINS for k in keys}
    for f in ok:
        assert f.routing is not None
        key = _worker_key(f.routing.worker_id, f.routing.dp_rank)
        start, end = f.record.start, f.record.end
        first, last = int(start / width), min(PLOT_BINS - 1, int(end / width))
        for i in range(first, last + 1):  # time-weighted requests in flight per bin
            lo, hi = max(start, i * width), min(end, (i + 1) * width)
            active[key][i] += max(0.0, hi - lo) / width
        b = min(PLOT_BINS - 1, first)
        prompt[key][b] += f.record.prompt_tokens or 0
        cached[key][b] += f.record.cached_tokens or 0
    centers = [(i + 0.5) * width for i in range(PLOT_BINS)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for key in keys:
        top.plot(centers, active[key], label=key)
        rate: list[float | None] = []
        total_c = total_p = 0
        for c, p in zip(cached[key], prompt[key], strict=True):
            total_c, total_p = total_c + c, total_p + p
            rate.append(total_c / total_p if total_p else None)
        bottom.plot(centers, rate, label=key)
    top.set(title="Requests in flight per worker", ylabel="requests")
    bottom.set(
        title="Prefix hit rate per worker (cumulative)",
        xlabel="simulated time (s)",
        ylabel="hit rate",
    )
    if len(keys) <= 16:
        top.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    path = directory / "workers.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]

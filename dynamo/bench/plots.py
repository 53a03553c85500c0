"""PNG plots of a run (matplotlib, the ``bench`` extra): TTFT and ITL distributions,
throughput over time, latency over time. Imported only when plots are asked for."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo.bench.request import RequestRecord


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError(
            "plots need matplotlib (pip install 'dynamo-py[bench]'), or pass --no-plots"
        ) from exc
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def write_plots(directory: Path, records: Sequence[RequestRecord], origin: float) -> list[Path]:
    """Write ttft.png, itl.png, throughput.png and latency.png into ``directory``."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.ok]
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = directory / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(ttft or [0.0], bins=50, color="tab:blue")
    ax.set(title="Time to first token", xlabel="TTFT (ms)", ylabel="requests")
    save(fig, "ttft.png")

    itl = [gap * 1000 for r in ok for gap in r.itl]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(itl or [0.0], bins=50, color="tab:orange")
    ax.set(title="Inter-token latency", xlabel="ITL (ms)", ylabel="token gaps")
    save(fig, "itl.png")

    ends = sorted(r.end - origin for r in ok)
    span = max(ends, default=0.0)
    bins = max(10, min(100, int(span) + 1))  # about 1 s per bin; at least 10 for short runs
    width = span / bins if span > 0 else 1.0
    requests = [0] * bins
    tokens = [0] * bins
    for r in ok:
        i = min(bins - 1, int((r.end - origin) / width))
        requests[i] += 1
        tokens[i] += r.output_tokens
    centers = [(i + 0.5) * width for i in range(bins)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(centers, [n / width for n in requests], color="tab:green", label="requests/s")
    ax.set(title="Throughput over time", xlabel="time (s)", ylabel="completed requests/s")
    twin = ax.twinx()
    twin.plot(centers, [n / width for n in tokens], color="tab:purple", label="output tok/s")
    twin.set_ylabel("output tokens/s")
    fig.legend(loc="upper right")
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    starts = [r.start - origin for r in ok]
    ax.scatter(starts, [r.e2e * 1000 for r in ok], s=4, label="end-to-end", color="tab:red")
    ttft_points = [(r.start - origin, r.ttft * 1000) for r in ok if r.ttft is not None]
    ax.scatter(
        [p[0] for p in ttft_points],
        [p[1] for p in ttft_points],
        s=4,
        label="TTFT",
        color="tab:blue",
    )
    ax.set(title="Latency over time", xlabel="request start (s)", ylabel="latency (ms)")
    ax.legend(loc="upper left")
    save(fig, "latency.png")
    return written

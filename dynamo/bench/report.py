"""Benchmark results: the summary (latency percentiles, throughput, errors, cache hits, CPU),
the per-request JSONL, the report folder, a text rendering, and ``compare``.

Summary figures: ``ttft_ms``, ``itl_ms``, ``tpot_ms``, ``e2e_latency_ms`` each with count,
mean, min, p50, p90, p99, max (percentiles interpolate linearly, as numpy's default);
throughputs over the measured window (first request sent -> last response ended).
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from dynamo import native
from dynamo.bench import _stats_fallback
from dynamo.bench._stats_fallback import percentile as percentile
from dynamo.bench.request import RequestRecord

SUMMARY_FILE = "summary.json"
REQUESTS_FILE = "requests.jsonl"
_LATENCY_KEYS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms")
_NOT_COMPARED = ("config", "date", "server", "error_examples", "version")


_impl = native.load(
    "dynamo.bench._stats",
    "dynamo.bench._stats_fallback",
    requires=("figures", "figures_joined", "record_figures"),
)
STATS_IMPLEMENTATION: str = _impl.__name__
"""The module computing :func:`stats` (``dynamo.bench._stats`` or its fallback)."""
_FIGURES = ("count", "mean", "min", "p50", "p90", "p99", "max")


def stats(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p99, max of ``values`` times ``scale`` (None when empty).

    The definition is ``_stats_fallback.figures``: the scaled values sorted, the mean their
    ``sum`` in that order over the count (the figures are bit-stable); the native module
    computes the same floats over an array of doubles (a replay's ITLs are one per token)."""
    data = values if type(values) is list else list(values)
    figures = _impl.figures(data, scale)
    if figures is None:  # the native module defers (a NaN, an unusual type): the definition
        figures = _stats_fallback.figures(data, scale)
    return _as_dict(figures)


def stats_joined(series: list[list[float]], scale: float = 1.0) -> dict[str, float | int | None]:
    """:func:`stats` of the series' values in order (one list per request, as the ITLs), read
    from the lists themselves (no joined list first)."""
    figures = _impl.figures_joined(series, scale)
    if figures is None:  # the native module defers: the definition
        figures = _stats_fallback.figures_joined(series, scale)
    return _as_dict(figures)


def _as_dict(figures: _stats_fallback.Figures) -> dict[str, float | int | None]:
    if not figures[0]:
        return dict.fromkeys(("mean", "min", "p50", "p90", "p99", "max"), None) | {"count": 0}
    return dict(zip(_FIGURES, figures, strict=True))


def summarize(
    records: Sequence[RequestRecord],
    *,
    window_s: float,
    config: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    server_cpu_s: dict[int, float] | None = None,
    client_cpu_s: float | None = None,
) -> dict[str, Any]:
    """The summary JSON object of one run (see the module docstring). The records are read
    in one pass (``_stats.record_figures``: a replay's are tens of thousands, and a pass a
    figure was ~4 % of its run, their attributes read in Python ~3 %)."""
    rows = records if type(records) is list else list(records)
    figures = _impl.record_figures(rows)
    if figures is None:  # the native module defers (an odd record or value): the definition
        figures = _stats_fallback.record_figures(rows)
    ok, failed, ttft, itl, tpot, e2e, inputs, outputs, output, prompt, cached, mismatch = figures
    errors: Counter[str] = Counter()
    examples: dict[str, str] = {}  # the first message of each error type
    for r in failed:
        errors[r.error] += 1
        if r.error not in examples:
            examples[r.error] = r.error_message or ""
    window = max(window_s, 1e-9)
    summary: dict[str, Any] = {
        "version": 1,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": config or {},
        "server": server or {},
        "duration_s": window_s,
        "requests": {"total": len(rows), "completed": ok, "failed": len(rows) - ok},
        "request_throughput_rps": ok / window,
        "output_token_throughput_tps": output / window,
        "input_token_throughput_tps": prompt / window,
        "ttft_ms": _as_dict(ttft),
        "itl_ms": _as_dict(itl),
        "tpot_ms": _as_dict(tpot),
        "e2e_latency_ms": _as_dict(e2e),
        "input_tokens": _as_dict(inputs),
        "output_tokens": _as_dict(outputs),
        "errors": dict(sorted(errors.items())),
        "error_examples": examples,
        "cache_hit_rate": cached / prompt if prompt else None,
        "prompt_tokens_mismatch": mismatch,
    }
    if server_cpu_s is not None:
        total = sum(server_cpu_s.values())
        summary["server_cpu"] = {
            "per_pid_s": {str(pid): seconds for pid, seconds in server_cpu_s.items()},
            "cpu_s": total,
            "cpu_ms_per_request": total * 1000 / ok if ok else None,
        }
    if client_cpu_s is not None:
        summary["client_cpu"] = {
            "cpu_s": client_cpu_s,
            "cpu_ms_per_request": client_cpu_s * 1000 / ok if ok else None,
        }
    return summary


def record_row(record: RequestRecord, index: int, origin: float) -> dict[str, Any]:
    """One JSONL row; times in ms, ``start_ms`` relative to ``origin`` (perf_counter)."""
    tpot = record.tpot
    return {
        "index": index,
        "session": record.session,
        "turn": record.turn,
        "group": record.group,
        "start_ms": (record.start - origin) * 1000,
        "ttft_ms": None if record.ttft is None else record.ttft * 1000,
        "e2e_ms": record.e2e * 1000,
        "tpot_ms": None if tpot is None else tpot * 1000,
        "itl_ms": [gap * 1000 for gap in record.itl],
        "max_tokens": record.max_tokens,
        "output_tokens": record.output_tokens,
        "expected_prompt_tokens": record.expected_prompt_tokens,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "finish_reason": record.finish_reason,
        "status": record.status,
        "error": record.error,
        "error_message": record.error_message,
    }


def write_report(
    directory: str | Path,
    summary: dict[str, Any],
    records: Sequence[RequestRecord],
    origin: float,
    *,
    plots: bool = True,
) -> list[Path]:
    """Write summary.json, requests.jsonl and (if ``plots``) PNGs; returns the written paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / SUMMARY_FILE
    summary_path.write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=2) + b"\n")
    ordered = sorted(records, key=lambda r: r.start)
    encode = msgspec.json.encode
    with (out / REQUESTS_FILE).open("wb") as file:
        for index, record in enumerate(ordered):
            file.write(encode(record_row(record, index, origin)) + b"\n")
    written = [summary_path, out / REQUESTS_FILE]
    if plots:
        from dynamo.bench.plots import write_plots

        written += write_plots(out / "plots", ordered, origin)
    return written


def load_summary(path: str | Path) -> dict[str, Any]:
    """A summary from ``summary.json`` or a report folder holding one; ValueError if not."""
    file = Path(path)
    if file.is_dir():
        file = file / SUMMARY_FILE
    try:
        data = msgspec.json.decode(file.read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read {file}: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"{file} is not JSON: {exc}") from None
    if not isinstance(data, dict) or "requests" not in data:
        raise ValueError(f"{file} is not a dynamo bench summary")
    return data


def flatten(summary: dict[str, Any]) -> dict[str, float]:
    """Every numeric figure as ``dotted.name -> value`` (config and metadata left out)."""
    flat: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[prefix] = float(value)

    for key, value in summary.items():
        if key not in _NOT_COMPARED:
            walk(key, value)
    return flat


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float | None, float | None]]:
    """``(figure, value in A, value in B)`` for every figure in either summary, A's order."""
    fa, fb = flatten(a), flatten(b)
    names = list(fa) + [name for name in fb if name not in fa]
    return [(name, fa.get(name), fb.get(name)) for name in names]


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if value == int(value) and abs(value) < 1e12:
        return f"{int(value)}"
    return f"{value:.4g}" if abs(value) < 1e-3 or abs(value) >= 1e6 else f"{value:.3f}"


def format_compare(rows: list[tuple[str, float | None, float | None]], a: str, b: str) -> str:
    """A table with the ratio B/A of every figure ("-" where undefined)."""
    width = max([len("figure"), *(len(name) for name, _, _ in rows)])
    lines = [f"A = {a}", f"B = {b}", f"{'figure':<{width}}  {'A':>12}  {'B':>12}  {'B/A':>8}"]
    for name, va, vb in rows:
        ratio = "-"
        if va is not None and vb is not None:
            ratio = f"{vb / va:.3f}" if va != 0 else ("1.000" if vb == 0 else "inf")
        lines.append(f"{name:<{width}}  {_num(va):>12}  {_num(vb):>12}  {ratio:>8}")
    return "\n".join(lines)


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a short human-readable table."""
    req = summary["requests"]
    lines = [
        f"requests: {req['completed']} ok, {req['failed']} failed in {summary['duration_s']:.2f} s",
        f"throughput: {summary['request_throughput_rps']:.2f} req/s, "
        f"{summary['output_token_throughput_tps']:.1f} output tok/s, "
        f"{summary['input_token_throughput_tps']:.1f} input tok/s",
        f"{'(ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in _LATENCY_KEYS:
        row = summary[key]
        cells = "".join(f"{_num(row[q]):>10}" for q in ("mean", "p50", "p90", "p99"))
        lines.append(f"{key.removesuffix('_ms'):<16}{cells}")
    hit = summary.get("cache_hit_rate")
    lines.append(f"cache hit rate: {'-' if hit is None else f'{hit:.3f}'}")
    if summary.get("prompt_tokens_mismatch"):
        lines.append(
            f"warning: {summary['prompt_tokens_mismatch']} requests had a server prompt_tokens "
            "different from the requested length (tokenizer or chat template mismatch?)"
        )
    if summary["errors"]:
        errors = ", ".join(f"{k} x{v}" for k, v in summary["errors"].items())
        lines.append(f"errors: {errors}")
        for kind, message in summary.get("error_examples", {}).items():
            lines.append(f"  {kind}: {message}")
    for key, label in (("server_cpu", "server CPU"), ("client_cpu", "client CPU")):
        cpu = summary.get(key)
        if cpu:
            per = cpu["cpu_ms_per_request"]
            lines.append(
                f"{label}: {cpu['cpu_s']:.2f} s, {'-' if per is None else f'{per:.3f}'} ms/request"
            )
    return "\n".join(lines)

"""dynamo bench's figures and loops: percentiles, the summary, compare, the load runner's
closed and open loops, the CPU meter, and CLI argument errors."""

from __future__ import annotations

import asyncio
import io
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from dynamo.bench.__main__ import build_parser, config_from_args, main
from dynamo.bench.cpu import CpuMeter, descendants, process_cpu_seconds
from dynamo.bench.report import (
    compare,
    flatten,
    format_compare,
    format_summary,
    load_summary,
    percentile,
    stats,
    summarize,
    write_report,
)
from dynamo.bench.request import RequestRecord, RequestSpec
from dynamo.bench.runner import Budget, LoadRunner, Progress
from dynamo.bench.workload import SingleRequest


def test_percentiles_interpolate_linearly() -> None:
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 50) == 5.5
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10
    assert percentile([3.0], 99) == 3.0
    row = stats([0.001, 0.002, 0.003], scale=1000.0)
    assert row["count"] == 3 and row["mean"] == pytest.approx(2.0) and row["p50"] == 2.0
    assert stats([])["p50"] is None and stats([])["count"] == 0


def record(start: float, ttft: float, end: float, **kw: object) -> RequestRecord:
    r = RequestRecord(start=start, max_tokens=4, expected_prompt_tokens=10)
    r.ttft, r.end, r.output_tokens = ttft, end, 4
    r.itl = [0.01, 0.02, 0.03]
    r.prompt_tokens, r.cached_tokens = 10, 5
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def test_summary_figures() -> None:
    records = [
        record(0.0, 0.1, 0.4),
        record(0.1, 0.2, 0.7, prompt_tokens=12),
        record(0.2, 0.3, 0.3, error="http_503", error_message="busy"),
    ]
    summary = summarize(records, window_s=1.0, server_cpu_s={7: 0.5}, client_cpu_s=0.1)
    assert summary["requests"] == {"total": 3, "completed": 2, "failed": 1}
    assert summary["request_throughput_rps"] == 2.0
    assert summary["output_token_throughput_tps"] == 8.0
    assert summary["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert summary["e2e_latency_ms"]["max"] == pytest.approx(600.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx((300 / 3 + 400 / 3) / 2)  # (e2e-ttft)/(n-1)
    assert summary["itl_ms"]["count"] == 6
    assert summary["errors"] == {"http_503": 1}
    assert summary["error_examples"] == {"http_503": "busy"}
    assert summary["cache_hit_rate"] == pytest.approx(10 / 22)
    assert summary["prompt_tokens_mismatch"] == 1
    assert summary["server_cpu"]["cpu_ms_per_request"] == pytest.approx(250.0)
    assert summary["client_cpu"]["cpu_ms_per_request"] == pytest.approx(50.0)
    text = format_summary(summary)
    assert "2 ok, 1 failed" in text and "http_503 x1" in text and "1 requests had" in text


def test_summary_is_each_figures_definition_on_mixed_records() -> None:
    """``summarize`` reads the records in one pass: each figure equals its definition over
    the records (failures, no first token, fewer than two tokens, no usage, mixed)."""
    rng = random.Random(7)
    records = []
    for i in range(400):
        start = rng.random()
        r = record(start, rng.random() / 10, start + rng.random())
        kind = rng.randrange(5)
        if kind == 0:
            r.error, r.error_message = rng.choice(["http_503", "timeout"]), f"m{i}"
        if kind == 1:
            r.ttft = None
        if kind == 2:
            r.prompt_tokens = None
        r.output_tokens = rng.choice([0, 1, 2, 9])
        r.cached_tokens = rng.choice([None, 0, 5])
        r.itl = [rng.random() for _ in range(rng.randrange(4))]
        records.append(r)
    ok = [r for r in records if r.ok]
    usage = [r for r in ok if r.prompt_tokens is not None]
    summary = summarize(records, window_s=2.0)
    assert summary["ttft_ms"] == stats([r.ttft for r in ok if r.ttft is not None], 1000.0)
    assert summary["tpot_ms"] == stats([r.tpot for r in ok if r.tpot is not None], 1000.0)
    assert summary["e2e_latency_ms"] == stats([r.e2e for r in ok], 1000.0)
    assert summary["itl_ms"] == stats([g for r in ok for g in r.itl], 1000.0)
    assert summary["input_tokens"] == stats([r.prompt_tokens or 0 for r in usage])
    assert summary["output_tokens"] == stats([r.output_tokens for r in ok])
    prompt = sum(r.prompt_tokens or 0 for r in usage)
    assert summary["cache_hit_rate"] == sum(r.cached_tokens or 0 for r in usage) / prompt
    assert summary["output_token_throughput_tps"] == sum(r.output_tokens for r in ok) / 2.0
    assert summary["prompt_tokens_mismatch"] == sum(
        r.prompt_tokens != r.expected_prompt_tokens for r in usage
    )
    failed = [r for r in records if not r.ok]
    assert summary["requests"] == {"total": 400, "completed": len(ok), "failed": len(failed)}
    assert summary["errors"] == {
        e: sum(r.error == e for r in failed) for e in sorted({r.error for r in failed})
    }
    first = {e: next(r.error_message for r in failed if r.error == e) for e in summary["errors"]}
    assert summary["error_examples"] == first


def test_compare_prints_the_ratio_of_every_figure(tmp_path: Path) -> None:
    a = summarize([record(0.0, 0.1, 0.4)], window_s=1.0, config={"isl": 5})
    b = summarize([record(0.0, 0.2, 0.4), record(0.0, 0.2, 0.4)], window_s=1.0)
    write_report(tmp_path / "a", a, [record(0.0, 0.1, 0.4)], 0.0, plots=False)
    (tmp_path / "b.json").write_bytes(msgspec.json.encode(b))
    loaded_a, loaded_b = load_summary(tmp_path / "a"), load_summary(tmp_path / "b.json")
    rows = {name: (va, vb) for name, va, vb in compare(loaded_a, loaded_b)}
    assert rows["request_throughput_rps"] == (1.0, 2.0)
    assert rows["ttft_ms.p50"] == pytest.approx((100.0, 200.0))
    assert "config.isl" not in rows and "date" not in rows
    assert set(rows) == set(flatten(a)) | set(flatten(b))
    table = format_compare(compare(loaded_a, loaded_b), "A", "B")
    line = next(x for x in table.splitlines() if x.startswith("request_throughput_rps "))
    assert line.split()[-1] == "2.000"
    zero = next(x for x in table.splitlines() if x.startswith("requests.failed "))
    assert zero.split()[-1] == "1.000"  # 0 vs 0
    lines = (tmp_path / "a" / "requests.jsonl").read_bytes().splitlines()
    assert msgspec.json.decode(lines[0])["ttft_ms"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="not a dynamo bench summary"):
        (tmp_path / "x.json").write_text("{}")
        load_summary(tmp_path / "x.json")


class FakeServer:
    """A ``send`` function that takes ``delay`` seconds and tracks requests in flight."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.in_flight = 0
        self.peak = 0
        self.sent_at: list[float] = []

    async def send(self, spec: RequestSpec) -> RequestRecord:
        self.sent_at.append(time.perf_counter())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        r = RequestRecord(start=time.perf_counter(), max_tokens=1, expected_prompt_tokens=1)
        await asyncio.sleep(self.delay)
        r.end = time.perf_counter()
        self.in_flight -= 1
        return r


def sessions(n: int | None = None) -> object:
    i = 0
    while n is None or i < n:
        yield SingleRequest(RequestSpec(max_tokens=1, expected_prompt_tokens=1, session=i))
        i += 1


async def test_closed_loop_keeps_exactly_c_requests_in_flight() -> None:
    server = FakeServer(0.01)
    progress = Progress(label="t", total=40, duration_s=None, enabled=True, stream=io.StringIO())
    runner = LoadRunner(send=server.send, budget=Budget(40), concurrency=4, progress=progress)
    records = await runner.run(sessions(), open_loop=False)  # type: ignore[arg-type]
    assert len(records) == 40 and server.peak == 4
    assert "40/40 req" in progress.line()


async def test_open_loop_follows_poisson_arrivals_and_caps_concurrency() -> None:
    server = FakeServer(0.05)
    runner = LoadRunner(send=server.send, budget=Budget(60), rate=200.0, max_concurrency=3)
    started = time.perf_counter()
    records = await runner.run(sessions(), open_loop=True)  # type: ignore[arg-type]
    assert len(records) == 60 and server.peak == 3  # the cap holds
    server = FakeServer(0.05)
    runner = LoadRunner(send=server.send, budget=Budget(100), rate=400.0, seed=1)
    started = time.perf_counter()
    await runner.run(sessions(), open_loop=True)  # type: ignore[arg-type]
    span = server.sent_at[-1] - started
    assert 0.12 < span < 0.6  # 100 arrivals at 400/s: ~0.25 s
    assert server.peak > 3  # an open loop does not wait for answers


async def test_a_duration_stops_new_requests() -> None:
    server = FakeServer(0.02)
    deadline = time.perf_counter() + 0.2
    runner = LoadRunner(send=server.send, budget=Budget(None, deadline), concurrency=2)
    records = await runner.run(sessions(), open_loop=False)  # type: ignore[arg-type]
    assert 4 <= len(records) <= 22
    assert all(r.start < deadline for r in records)


def test_cpu_meter_reads_proc() -> None:
    mine = process_cpu_seconds(os.getpid())
    assert mine is not None and mine > 0
    assert process_cpu_seconds(2**22 + 12345) is None
    meter = CpuMeter([os.getpid()])
    meter.check()
    meter.start()
    # A child born after start() spends 0.3 s of CPU, says so, then idles: the meter must count
    # it for its parent's tree. Waiting for its line (not a fixed sleep) keeps this true on a
    # starved machine, where 0.3 s of CPU can take many seconds of wall time.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nprint('spun', flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        assert child.pid in descendants(os.getpid())
        used = meter.stop()[os.getpid()]
        assert 0.3 <= used < 30
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ValueError, match="no process with PID"):
        CpuMeter([2**22 + 12345]).check()


def test_cli_argument_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["--extra-body", '{"top_k": 5}', "--server-pids", "1,2"])
    config = config_from_args(args)
    assert config.extra_body == {"top_k": 5} and config.server_pids == [1, 2]
    assert config.request_limit == 100
    for argv, message in [
        (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
        (["--server-pids", "x"], "--server-pids must be comma-separated integers"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--workload", "trace"], "--workload trace needs --trace FILE"),
        (["--url", "localhost:80"], "not an http(s) URL"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("dynamo bench: ") and message in err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert main(["compare", "/nonexistent/a", "/nonexistent/b"]) == 2
    assert "cannot read" in capsys.readouterr().err

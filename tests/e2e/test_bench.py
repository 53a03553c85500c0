"""dynamo bench against a real ``dynamo serve`` (frontend + 2 mocker processes, speedup 0):
every workload shape with the server's prompt_tokens equal to the requested length, trace
replay, open and closed loops, the report folder, compare, and the error cases."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from dynamo.bench import BenchConfig, BenchResult, run_benchmark
from dynamo.bench.__main__ import main
from dynamo.cli import main as dynamo_main

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 60.0


class Serve:
    def __init__(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.serve", "--http-host", "127.0.0.1"]
            + ["--http-port", "0", "--workers", "2", "--speedup-ratio", "0", "--block-size", "16"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.port = 0
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("dynamo frontend: listening on http://"):
                self.port = int(line.rsplit(":", 1)[1])
                self._ready.set()
        self._ready.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        if not self._ready.wait(STARTUP_S) or not self.port:
            raise AssertionError("dynamo serve did not start:\n" + "\n".join(self.lines[-30:]))
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as response:
                    if json.loads(response.read())["data"]:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("no model registered:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    server = Serve()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


async def bench(serve: Serve, **kw: object) -> BenchResult:
    options: dict[str, object] = {"progress": False, "plots": False, **kw}
    config = BenchConfig(url=serve.url, **options)  # type: ignore[arg-type]
    return await run_benchmark(config)


def assert_exact(result: BenchResult, count: int, osl: int | None = None) -> None:
    summary, records = result.summary, result.records
    assert summary["requests"] == {"total": count, "completed": count, "failed": 0}, summary
    assert summary["prompt_tokens_mismatch"] == 0
    for record in records:
        assert record.prompt_tokens == record.expected_prompt_tokens
        assert record.ttft is not None and record.ttft <= record.e2e
        if osl is not None:
            assert record.output_tokens == osl and record.finish_reason == "length"


async def test_synthetic_chat_exact_lengths_report_and_server_cpu(
    serve: Serve, tmp_path: Path
) -> None:
    result = await bench(
        serve,
        isl=100,
        isl_stddev=30,
        osl=12,
        concurrency=4,
        num_requests=24,
        warmup=4,
        output_dir=str(tmp_path / "report"),
        plots=True,
        server_pids=[serve.proc.pid],
    )
    assert_exact(result, 24, osl=12)
    assert len({r.prompt_tokens for r in result.records}) > 5  # lengths really vary
    summary = result.summary
    assert summary["ttft_ms"]["count"] == 24
    # One gap per pair of text chunks: at most OSL - 1 per request; fewer when a token's text is
    # held back (a split UTF-8 character) or a burst arrives as one chunk (at speedup 0 the
    # whole answer often does).
    assert 0 <= summary["itl_ms"]["count"] <= 24 * 11
    assert summary["output_token_throughput_tps"] > 0
    assert summary["server_cpu"]["cpu_s"] > 0  # the frontend and mockers under dynamo serve
    assert summary["server_cpu"]["cpu_ms_per_request"] > 0
    report = tmp_path / "report"
    assert len((report / "requests.jsonl").read_text().splitlines()) == 24
    written = msgspec.json.decode((report / "summary.json").read_bytes())
    assert written["requests"]["completed"] == 24 and written["config"]["isl"] == 100
    for name in ("ttft.png", "itl.png", "throughput.png", "latency.png"):
        assert (report / "plots" / name).read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("prompt_format", ["ids", "text"])
async def test_completions_prompts_have_exact_lengths(serve: Serve, prompt_format: str) -> None:
    result = await bench(
        serve,
        api="completions",
        prompt_format=prompt_format,
        isl=64,
        isl_stddev=20,
        osl=5,
        concurrency=2,
        num_requests=10,
    )
    assert_exact(result, 10, osl=5)


async def test_open_loop_with_a_duration(serve: Serve) -> None:
    started = time.perf_counter()
    result = await bench(serve, rate=40.0, duration_s=0.6, isl=64, osl=4)
    elapsed = time.perf_counter() - started
    count = result.summary["requests"]["total"]
    assert 5 <= count <= 60 and elapsed < 30
    assert_exact(result, count, osl=4)
    # Nothing starts after the duration (the slack is for the event loop on a busy machine).
    assert max(r.start for r in result.records) - result.origin < 0.6 + 0.2


async def test_prefix_groups_share_their_prefix_in_the_server_cache(serve: Serve) -> None:
    result = await bench(
        serve,
        workload="prefix",
        prefix_groups=2,
        prefix_len=128,
        suffix_len=32,
        osl=4,
        num_requests=16,
        seed=11,
    )
    assert_exact(result, 16, osl=4)
    assert {r.group for r in result.records} == {0, 1}
    assert all(r.prompt_tokens == 160 for r in result.records)
    # Each group misses at most once per worker; later requests reuse 128 of 160 tokens.
    assert result.summary["cache_hit_rate"] > 0.4


async def test_multi_turn_sessions_grow(serve: Serve) -> None:
    result = await bench(
        serve, workload="multi-turn", turns=3, isl=40, osl=8, concurrency=3, num_requests=9
    )
    assert_exact(result, 9, osl=8)
    by_session: dict[int, list[int]] = {}
    for record in sorted(result.records, key=lambda r: r.turn):
        by_session.setdefault(record.session, []).append(record.prompt_tokens or 0)
    # A worker that finishes its session early may start another before the budget ends.
    assert sum(len(lengths) == 3 for lengths in by_session.values()) >= 2
    for lengths in by_session.values():
        assert lengths[0] == 40
        for before, after in zip(lengths, lengths[1:], strict=False):
            assert after > before + 40  # previous answer (8 tokens) + 40 new words + headers


async def test_trace_replay(serve: Serve, tmp_path: Path) -> None:
    rows = [
        {
            "timestamp": 100 * i,
            "input_length": 60 + 12 * i,
            "output_length": 3 + i % 3,
            "hash_ids": [1, 2, 100 + i],
        }
        for i in range(10)
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = await bench(
        serve, workload="trace", trace=str(trace), trace_block_size=32, trace_speedup=2.0
    )
    assert_exact(result, 10)
    records = sorted(result.records, key=lambda r: r.start)
    assert [r.prompt_tokens for r in records] == [row["input_length"] for row in rows]
    assert [r.output_tokens for r in records] == [row["output_length"] for row in rows]
    offsets = [r.start - result.origin for r in records]
    assert offsets[-1] >= 0.45 - 0.01  # 900 ms of trace at 2x
    assert result.summary["cache_hit_rate"] > 0.1  # hash ids 1, 2 are shared


def test_cli_report_and_compare(
    serve: Serve, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--url", serve.url, "--isl", "50", "--osl", "6", "--no-plots"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main([*common, "--num-requests", "6", "--output-dir", a]) == 0
    out = capsys.readouterr().out
    assert "requests: 6 ok, 0 failed" in out and "ttft" in out
    assert dynamo_main(["bench", "run", *common, "--num-requests", "12", "--concurrency", "3",
                        "--output-dir", b, "--json"]) == 0  # fmt: skip
    assert msgspec.json.decode(capsys.readouterr().out)["requests"]["completed"] == 12
    assert main(["compare", a, str(Path(b) / "summary.json")]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[3:]}
    assert rows["requests.completed"] == ["6", "12", "2.000"]
    for figure in ("request_throughput_rps", "ttft_ms.p50", "e2e_latency_ms.mean"):
        va, vb, ratio = (float(x) for x in rows[figure])
        assert ratio > 0 and ratio == pytest.approx(vb / va, rel=0.01)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class _Handler(http.server.BaseHTTPRequestHandler):
    mode = "html"

    def _reply(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.mode == "html":
            self._reply(404, "text/html", b"<html><body>Not Found</body></html>")
        elif self.mode == "html200":
            self._reply(200, "text/html", b"<html><body>hello</body></html>")
        else:
            self._reply(200, "application/json", b'{"object":"list","data":[{"id":"demo"}]}')

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._reply(200, "application/json", b'{"choices":[{"message":{"content":"hi"}}]}')

    def log_message(self, *args: object) -> None:
        pass


def fake_server(mode: str) -> http.server.ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"mode": mode})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("dynamo bench: ")
    return err


def test_error_cases(serve: Serve, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    assert "cannot connect to " + closed in run_error(["--url", closed], capsys)
    for mode, message in [
        ("html", "is not an OpenAI-compatible server: GET /v1/models returned HTTP 404"),
        ("html200", "GET /v1/models did not return a model list (got text/html)"),
        ("json", "not an OpenAI-compatible streaming endpoint: expected an SSE stream"),
    ]:
        server = fake_server(mode)
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            assert message in run_error(["--url", url, "--num-requests", "2"], capsys)
        finally:
            server.shutdown()
            server.server_close()
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": 40, "output_length": 2}\n'
    )
    err = run_error(["--url", serve.url, "--workload", "trace", "--trace", str(trace)], capsys)
    assert f"{trace} line 2: missing field 'hash_ids'" in err
    err = run_error(["--url", serve.url, "--model", "nope"], capsys)
    assert "does not serve model 'nope' (it serves demo)" in err
    err = run_error(["--url", serve.url, "--isl", "10"], capsys)
    assert "below this prompt form's minimum of 27" in err
    # The module entry point behaves the same in its own process.
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo.bench", "--url", closed],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("dynamo bench: cannot connect")
    assert "Traceback" not in proc.stderr

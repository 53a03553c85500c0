"""Abuse benchmark (issue 12): a normal request's latency while hostile clients are at work.

Our frontend and one mocker (speedup 0), each in its own process with file discovery. Two
phases, each measuring ``--requests`` sequential streaming chat requests (ISL ~32, OSL 8) on one
keep-alive connection: time to first token (the first SSE data chunk) and end to end.

1. idle: nothing else is connected.
2. abuse: while measuring, ``--idle`` connections that never send a byte (re-opened when the
   server closes them), ``--slow`` connections that declare a 1,000-byte body and send one byte
   every 0.2 s, and one ``--huge-mb`` MB chat prompt (uploaded once at the start; refused with
   a 400 before it is tokenized).

Goal: the abuse phase's TTFT p99 within 2x of the idle phase's.

    .venv/bin/python benchmarks/abuse.py                 # 500 requests per phase
    .venv/bin/python benchmarks/abuse.py --requests 200  # quicker

Results: a table on stdout and JSON in ``bench-results/abuse.json``.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import multiprocessing
import os
import platform
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also under `python -m benchmarks...`

from launcher import MODEL, REPO, Child, service_env  # noqa: E402

GOAL_P99_RATIO = 2.0
CHAT = "/v1/chat/completions"


def measure(port: int, requests: int, stop_early: threading.Event | None = None) -> list[float]:
    """TTFT (ms) of ``requests`` sequential streamed chat requests on one connection."""
    body = json.dumps(
        {
            "model": "demo",
            "messages": [{"role": "user", "content": "tell me a story about a dragon " * 4}],
            "max_tokens": 8,
            "stream": True,
            "nvext": {"ignore_eos": True},
        }
    ).encode()
    headers = {"content-type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    ttfts: list[float] = []
    try:
        for _ in range(requests):
            started = time.perf_counter()
            conn.request("POST", CHAT, body=body, headers=headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"status {resp.status}: {resp.read()[:200]!r}")
            first = None
            while line := resp.readline():
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter()
                if line.startswith(b"data: [DONE]"):
                    break
            resp.read()
            assert first is not None
            ttfts.append((first - started) * 1000)
    finally:
        conn.close()
    return ttfts


class Abuser:
    """Idle connections, slow bodies and one huge prompt, from threads of another process (see
    :func:`abuse`), so that the measuring client shares no GIL with them."""

    def __init__(self, port: int, idle: int, slow: int, huge_mb: int) -> None:
        self.port = port
        self.idle_target = idle
        self.slow_target = slow
        self.huge_mb = huge_mb
        text = "word " * (huge_mb * 1024 * 1024 // 5)
        self.huge_body = json.dumps(
            {"model": "demo", "messages": [{"role": "user", "content": text}]}
        ).encode()
        self.stop = threading.Event()
        self.huge_status: int | None = None
        self.huge_s = 0.0
        self.reopened = 0
        self.slow_answers: dict[str, int] = {}
        self._threads = [
            threading.Thread(target=self._idle, daemon=True),
            threading.Thread(target=self._slow, daemon=True),
            threading.Thread(target=self._huge, daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(30)

    def _connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def _idle(self) -> None:
        # Waits in select(): an idle socket costs nothing until the server closes it.
        sel = selectors.DefaultSelector()
        for _ in range(self.idle_target):
            sel.register(self._connect(), selectors.EVENT_READ)
        while not self.stop.is_set():
            for key, _ in sel.select(timeout=0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                sel.unregister(sock)
                sock.close()
                sel.register(self._connect(), selectors.EVENT_READ)
                self.reopened += 1
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()

    def _slow(self) -> None:
        head = (
            f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "content-length: 1000\r\n\r\n"
        ).encode()
        socks = []
        for _ in range(self.slow_target):
            sock = self._connect()
            sock.sendall(head)
            socks.append(sock)
        while not self.stop.wait(0.2):
            for sock in socks:
                try:
                    sock.send(b" ")
                except OSError:
                    pass
        for sock in socks:
            sock.close()

    def _huge(self) -> None:
        time.sleep(1.0)  # once the measurement runs
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        started = time.perf_counter()
        try:
            headers = {"content-type": "application/json"}
            conn.request("POST", CHAT, body=self.huge_body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            self.huge_status = resp.status
        except OSError as exc:
            self.huge_status = -1
            print(f"huge prompt: {exc}", file=sys.stderr)
        finally:
            self.huge_s = time.perf_counter() - started
            conn.close()


def abuse(port: int, idle: int, slow: int, huge_mb: int, ready: Any, stop: Any, out: Any) -> None:
    """The abuser process: set up, say ready, abuse until told to stop, report."""
    abuser = Abuser(port, idle, slow, huge_mb)
    abuser.start()
    time.sleep(0.5)  # idle and slow connections open
    ready.set()
    stop.wait()
    abuser.join()
    out.put(
        {"huge_status": abuser.huge_status, "huge_s": abuser.huge_s, "reopened": abuser.reopened}
    )


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    return {
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


def git_commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    return out.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--slow", type=int, default=50)
    parser.add_argument("--huge-mb", type=int, default=40)
    parser.add_argument("--out", default=str(REPO / "bench-results" / "abuse.json"))
    args = parser.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    discovery = tempfile.TemporaryDirectory(prefix="dynamo-abuse-")
    env = service_env(discovery.name)
    mocker = Child(
        "mocker",
        ["-m", "dynamo.mocker", "--model-path", str(MODEL), "--model-name", "demo"]
        + ["--speedup-ratio", "0"],
        env,
    )
    frontend = Child(
        "frontend", ["-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", "0"], env
    )
    try:
        port = frontend.port()
        deadline = time.monotonic() + 60
        while True:
            try:
                measure(port, 1)
                break
            except (OSError, RuntimeError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        measure(port, 50)  # warm-up
        idle = measure(port, args.requests)
        ctx = multiprocessing.get_context("spawn")
        ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(
            target=abuse, args=(port, args.idle, args.slow, args.huge_mb, ready, stop, out)
        )
        proc.start()
        try:
            if not ready.wait(120):
                raise RuntimeError("the abuser did not start")
            abused = measure(port, args.requests)
        finally:
            stop.set()
            report = out.get(timeout=60)
            proc.join(30)
    finally:
        frontend.stop()
        mocker.stop()
        discovery.cleanup()
    idle_p, abused_p = percentiles(idle), percentiles(abused)
    ratio = abused_p["p99"] / idle_p["p99"]
    print(f"{'phase':<8} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}  (TTFT ms)")
    for name, p in (("idle", idle_p), ("abuse", abused_p)):
        print(f"{name:<8} {p['p50']:8.2f} {p['p90']:8.2f} {p['p99']:8.2f} {p['max']:8.2f}")
    print(f"p99 ratio {ratio:.2f} (goal <= {GOAL_P99_RATIO})")
    print(
        f"huge prompt: status {report['huge_status']} after {report['huge_s']:.2f} s; "
        f"idle connections re-opened after the server closed them: {report['reopened']}"
    )
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {os.cpu_count()} cpus",
        "commit": git_commit(),
        "requests_per_phase": args.requests,
        "idle_connections": args.idle,
        "slow_bodies": args.slow,
        "huge_prompt_mb": args.huge_mb,
        "ttft_ms": {"idle": idle_p, "abuse": abused_p},
        "p99_ratio": ratio,
        "goal_p99_ratio": GOAL_P99_RATIO,
        "met": ratio <= GOAL_P99_RATIO,
        "huge_prompt_status": report["huge_status"],
        "huge_prompt_s": report["huge_s"],
        "idle_reopened": report["reopened"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

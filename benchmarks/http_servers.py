"""Benchmark candidate Python HTTP servers on the frontend's streaming SSE workload.

Each candidate serves POST /v1/chat/completions: decode a small JSON body, stream 64
chat.completion.chunk SSE events (msgspec) and `data: [DONE]`. For each we run wrk at
concurrency 64 (keep-alive) and 1, read the server's CPU seconds (utime+stime of the whole
process tree) from /proc, time TTFT over keep-alive with a raw-socket client, and read
TCP_NODELAY off the server's accepted socket (pidfd_getfd). Also times JSON encoders per chunk.

    .venv/bin/python -m benchmarks.http_servers [--duration 10] [--repeats 3] [--only NAME ...]

Needs `wrk` on PATH. Results go to bench-results/http_servers.json.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BIN = Path(PY).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
BODY = json.dumps(
    {
        "model": "demo",
        "messages": [{"role": "user", "content": "Tell me a short story about a fox."}],
        "stream": True,
        "max_tokens": 64,
    }
)
PATH = "/v1/chat/completions"

WRK_LUA = """
wrk.method = "POST"
wrk.body = [[@BODY@]]
wrk.headers["Content-Type"] = "application/json"
function done(summary, latency, requests)
  io.write(string.format(
    "WRKJSON {\\"requests\\": %d, \\"duration_us\\": %d, \\"errors\\": %d, "
    .. "\\"p50_us\\": %d, \\"p90_us\\": %d, \\"p99_us\\": %d, \\"mean_us\\": %f}\\n",
    summary.requests, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write
      + summary.errors.status + summary.errors.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
""".replace("@BODY@", BODY)


def _granian(interface: str, target: str) -> list[str]:
    return [
        str(BIN / "granian"), "--interface", interface, "--workers", "1", "--loop", "uvloop",
        "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning",
        "--no-access-log", target,
    ]  # fmt: skip


APPS = "benchmarks.http_servers_apps"
CANDIDATES: dict[str, list[str]] = {
    "granian-rsgi": _granian("rsgi", f"{APPS}.rsgi_app:app"),
    "granian-rsgi-embed": [PY, "-m", f"{APPS}.embed_rsgi", "{port}"],
    "granian-asgi-blacksheep": _granian("asgi", f"{APPS}.blacksheep_app:app"),
    "granian-asgi-starlette": _granian("asgi", f"{APPS}.starlette_app:app"),
    "uvicorn-starlette": [
        str(BIN / "uvicorn"),
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--log-level",
        "warning",
        "--no-access-log",
        f"{APPS}.starlette_app:app",
    ],  # fmt: skip
    "dynamo-front": [PY, "-m", f"{APPS}.dynamo_front", "{port}"],
    "aiohttp": [PY, "-m", f"{APPS}.aiohttp_app", "{port}"],
    "raw-httptools (reference)": [PY, "-m", f"{APPS}.raw_httptools", "{port}"],
    # Control: Nagle deliberately left on, to show the NODELAY probe and stall counter work.
    "raw-httptools-nagle (control)": [
        "env",
        "BENCH_NODELAY=0",
        PY,
        "-m",
        f"{APPS}.raw_httptools",
        "{port}",
    ],  # fmt: skip
}


@dataclass(slots=True)
class WrkRun:
    concurrency: int
    req_s: float
    requests: int
    errors: int
    cpu_s: float
    cpu_ms_per_req: float
    server_cores: float
    p50_ms: float
    p99_ms: float


@dataclass(slots=True)
class Result:
    name: str
    runs_c64: list[WrkRun] = field(default_factory=list)
    runs_c1: list[WrkRun] = field(default_factory=list)
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    total_p50_ms: float = 0.0
    total_p99_ms: float = 0.0
    stalls_over_30ms: int = 0
    tcp_nodelay: bool | None = None
    error: str | None = None


# ---------------------------------------------------------------- process / CPU accounting


def _proc_tree(root: int) -> list[int]:
    """root and all its descendants (granian spawns worker processes)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _cpu_s(pids: list[int]) -> float:
    """utime+stime (all threads) of the given processes, in seconds."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(f[11]) + int(f[12])  # fields 14, 15: utime, stime
    return ticks / CLK_TCK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- clients


def _request_bytes(port: int) -> bytes:
    return (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n{BODY}"
    ).encode()


def _read_response(sock: socket.socket, t0: float) -> tuple[float, float]:
    """Read one chunked SSE response; (time to first `data:` byte, time to end) in seconds."""
    buf = b""
    ttft = -1.0
    while True:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        buf += data
        if ttft < 0 and b"data:" in buf:
            ttft = time.perf_counter() - t0
        if buf.endswith(b"0\r\n\r\n") and b"[DONE]" in buf:
            return ttft, time.perf_counter() - t0


def _wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(_request_bytes(port))
                _read_response(s, time.perf_counter())
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("server did not become ready")


def _ttft(port: int, n: int) -> tuple[list[float], list[float]]:
    """n sequential requests on ONE keep-alive connection (where Nagle stalls show)."""
    ttfts, totals = [], []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # client side never the cause
        req = _request_bytes(port)
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(req)
            a, b = _read_response(s, t0)
            ttfts.append(a)
            totals.append(b)
    return ttfts, totals


_SYS_PIDFD_OPEN = 434
_SYS_PIDFD_GETFD = 438


def _server_nodelay(port: int, pids: list[int]) -> bool | None:
    """Read TCP_NODELAY on the server's accepted socket of a live connection (pidfd_getfd)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(_request_bytes(port))
        _read_response(c, time.perf_counter())
        cport = c.getsockname()[1]
        # inode of the server-side socket: local=port, remote=cport in /proc/net/tcp
        inode = None
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].split(":")[1], 16) == port and int(f[2].split(":")[1], 16) == cport:
                inode = f[9]
        if inode is None:
            return None
        for pid in pids:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") != f"socket:[{inode}]":
                        continue
                    pidfd = libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
                    if pidfd < 0:
                        return None
                    try:
                        local = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(fd), 0)
                        if local < 0:
                            return None
                        with socket.socket(fileno=local) as dup:
                            return bool(dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                    finally:
                        os.close(pidfd)
    return None


def _wrk(port: int, pids: list[int], conns: int, duration: int, lua: str) -> WrkRun:
    cpu0 = _cpu_s(pids)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{duration}s", "--timeout", "10s", "-s", lua,
         f"http://127.0.0.1:{port}{PATH}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    cpu = _cpu_s(pids) - cpu0
    line = next(x for x in out.splitlines() if x.startswith("WRKJSON "))
    d = json.loads(line[len("WRKJSON ") :])
    reqs = max(int(d["requests"]), 1)
    secs = d["duration_us"] / 1e6
    return WrkRun(
        concurrency=conns,
        req_s=round(reqs / secs, 1),
        requests=reqs,
        errors=int(d["errors"]),
        cpu_s=round(cpu, 2),
        cpu_ms_per_req=round(cpu * 1000 / reqs, 3),
        server_cores=round(cpu / secs, 2),
        p50_ms=round(d["p50_us"] / 1000, 2),
        p99_ms=round(d["p99_us"] / 1000, 2),
    )


@contextlib.contextmanager
def _server(cmd: list[str]) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = _free_port()
    argv = [a.replace("{port}", str(port)) for a in cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        _wait_ready(port, proc)
        yield port, proc
    finally:
        for pid in reversed(_proc_tree(proc.pid)[1:]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def bench_server(name: str, cmd: list[str], duration: int, repeats: int, lua: str) -> Result:
    res = Result(name)
    try:
        with _server(cmd) as (port, proc):
            pids = _proc_tree(proc.pid)
            res.tcp_nodelay = _server_nodelay(port, pids)
            _wrk(port, pids, 64, 2, lua)  # warm-up
            ttfts, totals = _ttft(port, 300)
            ms = sorted(x * 1000 for x in ttfts)
            tot = sorted(x * 1000 for x in totals)
            res.ttft_p50_ms = round(statistics.median(ms), 3)
            res.ttft_p99_ms = round(ms[int(len(ms) * 0.99) - 1], 3)
            res.total_p50_ms = round(statistics.median(tot), 3)
            res.total_p99_ms = round(tot[int(len(tot) * 0.99) - 1], 3)
            res.stalls_over_30ms = sum(1 for x in tot if x > 30)
            for _ in range(repeats):
                res.runs_c64.append(_wrk(port, pids, 64, duration, lua))
                res.runs_c1.append(_wrk(port, pids, 1, max(duration // 2, 3), lua))
    except Exception as e:  # noqa: BLE001 - a failing candidate is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---------------------------------------------------------------- JSON encoders


def bench_json(n: int = 20000) -> dict[str, float]:
    """µs per ~200-byte chat.completion.chunk, encoder only (best of 5)."""
    import msgspec

    from benchmarks.http_servers_apps.common import make_chunk

    chunk = make_chunk("chatcmpl-" + "ab" * 12, int(time.time()), "demo-model", 5)
    as_dict = msgspec.to_builtins(chunk)
    enc = msgspec.json.Encoder()
    cases: dict[str, Callable[[], bytes]] = {
        "stdlib json.dumps(dict).encode()": lambda: json.dumps(as_dict).encode(),
        "stdlib json.dumps(dict, separators=compact).encode()": lambda: json.dumps(
            as_dict, separators=(",", ":")
        ).encode(),
        "msgspec Encoder.encode(Struct)": lambda: enc.encode(chunk),
        "msgspec Encoder.encode(dict)": lambda: enc.encode(as_dict),
    }
    try:  # not a dependency: measured where it is installed
        import orjson

        cases["orjson.dumps(dict)"] = lambda: orjson.dumps(as_dict)
    except ImportError:
        pass
    out: dict[str, float] = {"chunk_bytes": float(len(enc.encode(chunk)))}
    for label, fn in cases.items():
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n)
        out[label] = round(best * 1e6, 3)
    return out


# ---------------------------------------------------------------- main


def _summary(r: Result) -> str:
    if r.error:
        return f"{r.name:28s} ERROR {r.error}"
    best = max(r.runs_c64, key=lambda w: w.req_s)
    cpu = [w.cpu_ms_per_req for w in r.runs_c64]
    rps = [w.req_s for w in r.runs_c64]
    # a run that completed almost nothing (a stuck connection) says nothing about latency
    c1 = [w.p50_ms for w in r.runs_c1 if w.requests >= 10] or [float("nan")]
    return (
        f"{r.name:28s} req/s best {best.req_s:7.0f} (runs {'/'.join(f'{x:.0f}' for x in rps)})  "
        f"CPU ms/req min {min(cpu):.3f} med {statistics.median(cpu):.3f}  "
        f"cores {best.server_cores}  "
        f"c1 p50 {min(c1):.2f} ms  ttft p50 {r.ttft_p50_ms:.2f} total p50/p99 "
        f"{r.total_p50_ms:.2f}/{r.total_p99_ms:.2f} stalls {r.stalls_over_30ms}  "
        f"nodelay {r.tcp_nodelay}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=int, default=10, help="seconds per c=64 wrk run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="candidate names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "http_servers.json"))
    args = ap.parse_args()

    results: list[Result] = []
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_LUA)
        lua = f.name
    try:
        for name, cmd in CANDIDATES.items():
            if args.only and name not in args.only:
                continue
            r = bench_server(name, cmd, args.duration, args.repeats, lua)
            print(_summary(r), flush=True)
            results.append(r)
    finally:
        os.unlink(lua)
    js = bench_json()
    for k, v in js.items():
        print(f"json {k:55s} {v}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": platform.node(),
                "cpus": os.cpu_count(),
                "load_avg_at_end": os.getloadavg(),
                "events_per_response": 64,
                "servers": [asdict(r) for r in results],
                "json_us_per_chunk": js,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

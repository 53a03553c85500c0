"""Benchmark the standalone slot tracker with wrk (issue 6).

Two scenarios against one service with 4 registered workers, 16 connections:
  * potential_loads: POST /potential_loads with 32 sequence hashes;
  * add_free: alternating POST /add (32 hashes) and POST /free of the request added LAG adds
    earlier (unique request ids from a wrk Lua script).
The tracker is preloaded with requests sharing prefixes, so projections intersect real blocks.
Reports req/s, latency p50/p99 and the server's CPU time per request; writes JSON.

    .venv/bin/python benchmarks/slot_tracker.py [--duration 10] [--reference-python PY]

``--reference-python`` runs the same scenarios against another implementation of
``python -m dynamo.slot_tracker`` (e.g. NVIDIA's, installed in a separate venv), side by side.
Requires ``wrk`` (Debian: ``apt-get install -y wrk``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also under `python -m benchmarks...`

from launcher import cpu_seconds, free_port, isolate_network  # noqa: E402

MODEL = "bench"
GROUPS = 8  # prefix groups; each request shares a 16-block prefix with its group
_LAT = re.compile(r"^\s+(50|75|90|99)(?:\.0+)?%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}

ADD_FREE_LUA = r"""
local counter = 0
function setup(thread)
  counter = counter + 1
  thread:set("tid", counter)
end
function init(args)
  run = args[1] or "r"
  n = 0
  hdr = {["Content-Type"] = "application/json"}
  shared = {%(shared)s}
end
local function unique(k)
  local t = {}
  for i = 1, %(unique)d do t[i] = string.format("%%d", (tid * 1000000007 + k) * 64 + i) end
  return table.concat(t, ",")
end
function request()
  n = n + 1
  local k = math.floor((n + 1) / 2)
  if n %% 2 == 1 then
    local body = string.format(
      '{"model_name":"%(model)s","request_id":"%%s-t%%d-%%d","worker_id":%%d,"dp_rank":0,' ..
      '"sequence_hashes":[%%s,%%s],"new_isl_tokens":512}',
      run, tid, k, k %% %(workers)d, shared[(k %% %(groups)d) + 1], unique(k))
    return wrk.format("POST", "/add", hdr, body)
  end
  local body = string.format(
    '{"model_name":"%(model)s","request_id":"%%s-t%%d-%%d"}', run, tid, k - %(lag)d)
  return wrk.format("POST", "/free", hdr, body)
end
"""

POTENTIAL_LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[%(body)s]]
"""


def _signed(rng: random.Random) -> int:
    return rng.getrandbits(64) - (1 << 63)


class Service:
    """One slot tracker subprocess on a free loopback port."""

    def __init__(self, python: str, label: str) -> None:
        self.label = label
        self.port = free_port()
        cmd = [python, "-m", "dynamo.slot_tracker", "--port", str(self.port)]
        if label == "dynamo-py":  # the reference (1.6.1) has no --host: it binds 0.0.0.0, in
            cmd += ["--host", "127.0.0.1"]  # the benchmark's own network namespace
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Outside the checkout, so that `-m dynamo...` finds the other install's package.
            cwd=tempfile.gettempdir() if label != "dynamo-py" else None,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{label}: slot tracker did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _prepare(svc: Service, shared: list[list[int]], workers: int, preload: int) -> None:
    with httpx.Client(base_url=svc.url, timeout=10) as client:
        for worker in range(workers):
            body = {"worker_id": worker, "model_name": MODEL, "block_size": 16}
            resp = client.post("/register", json=body | {"dp_start": 0, "dp_size": 1})
            resp.raise_for_status()
        rng = random.Random(7)
        for i in range(preload):
            hashes = shared[i % GROUPS] + [_signed(rng) for _ in range(16)]
            body2 = {"model_name": MODEL, "request_id": f"preload-{i}", "worker_id": i % workers}
            body2 |= {"dp_rank": 0, "sequence_hashes": hashes, "new_isl_tokens": 512}
            client.post("/add", json=body2).raise_for_status()


def _wrk(
    url: str, script: Path, args: argparse.Namespace, duration: int, pid: int
) -> dict[str, Any]:
    cmd = ["wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{duration}s", "--latency"]
    cpu0 = cpu_seconds(pid)
    run_id = f"r{time.monotonic_ns()}"  # unique request ids per wrk run
    out = subprocess.run(
        [*cmd, "-s", str(script), url, "--", run_id], capture_output=True, text=True, check=True
    ).stdout
    cpu = cpu_seconds(pid) - cpu0
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    lat = {f"p{m[0]}_ms": round(float(m[1]) * _UNIT[m[2]], 3) for m in _LAT.findall(out)}
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errs = re.search(r"Socket errors: (.*)", out)
    return {
        "requests": total,
        "req_per_s": round(rps),
        **lat,
        "non_2xx": int(bad.group(1)) if bad else 0,
        "socket_errors": errs.group(1) if errs else None,
        "server_cpu_us_per_req": round(cpu / total * 1e6, 1) if total else None,
    }


def _scripts(args: argparse.Namespace, tmp: Path) -> tuple[list[list[int]], dict[str, Path]]:
    rng = random.Random(1)
    shared = [[_signed(rng) for _ in range(16)] for _ in range(GROUPS)]
    query = shared[0] + [_signed(rng) for _ in range(args.hashes - 16)]
    body = json.dumps({"model_name": MODEL, "sequence_hashes": query, "new_isl_tokens": 512})
    potential = tmp / "potential.lua"
    potential.write_text(POTENTIAL_LUA % {"body": body})
    add_free = tmp / "add_free.lua"
    lua_shared = ",".join('"' + ",".join(map(str, group)) + '"' for group in shared)
    add_free.write_text(
        ADD_FREE_LUA
        % {
            "shared": lua_shared,
            "unique": args.hashes - 16,
            "model": MODEL,
            "workers": args.workers,
            "groups": GROUPS,
            "lag": args.lag,
        }
    )
    return shared, {"potential_loads": potential, "add_free": add_free}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each figure over the rounds, plus the rounds themselves."""
    keys = ("req_per_s", "p50_ms", "p99_ms", "server_cpu_us_per_req")
    out: dict[str, Any] = {
        k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in keys
    }
    out["non_2xx"] = sum(r["non_2xx"] for r in runs)
    out["rounds"] = runs
    return out


def run_all(services: list[Service], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Each scenario, round by round, alternating services so that noise hits all alike."""
    shared, scripts = _scripts(args, tmp)
    for svc in services:
        _prepare(svc, shared, args.workers, args.preload)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s.label: {} for s in services}
    for name, script in scripts.items():
        if name not in args.scenarios:
            continue
        path = "/potential_loads" if name == "potential_loads" else "/"
        for svc in services:
            _wrk(svc.url + path, script, args, args.warmup, svc.proc.pid)
        for _ in range(args.rounds):
            for svc in services:
                result = _wrk(svc.url + path, script, args, args.duration, svc.proc.pid)
                runs[svc.label].setdefault(name, []).append(result)
                print(f"  {svc.label} {name}: {result}", flush=True)
    results: dict[str, Any] = {}
    for svc in services:
        results[svc.label] = {name: _summary(r) for name, r in runs[svc.label].items()}
        loads = httpx.get(svc.url + "/loads", params={"model_name": MODEL}, timeout=10).json()
        results[svc.label]["decode_blocks_after"] = sum(x["active_decode_blocks"] for x in loads)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per scenario")
    parser.add_argument("--warmup", type=int, default=2, help="seconds")
    parser.add_argument("--rounds", type=int, default=3, help="runs per scenario (median)")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--hashes", type=int, default=32)
    parser.add_argument("--preload", type=int, default=256, help="requests active beforehand")
    parser.add_argument("--lag", type=int, default=64, help="free the request added LAG adds ago")
    parser.add_argument("--reference-python", default=None)
    parser.add_argument(
        "--scenarios",
        default="potential_loads,add_free",
        type=lambda text: text.split(","),
        help="comma-separated subset of potential_loads,add_free",
    )
    parser.add_argument("--output", default="bench-results/slot_tracker.json")
    args = parser.parse_args()
    if args.hashes < 16:
        parser.error("--hashes must be at least 16 (16 shared + the rest unique)")
    if shutil.which("wrk") is None:
        print(
            "wrk not found: this benchmark drives the service with wrk (a C load generator, so\n"
            "that the client is not what is measured). Install it: apt-get install -y wrk",
            file=sys.stderr,
        )
        return 2
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "python": platform.python_version(),
        "wrk": {"threads": args.threads, "connections": args.connections},
        "setup": {
            "workers": args.workers,
            "hashes_per_request": args.hashes,
            "preloaded_requests": args.preload,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "free_lag": args.lag,
        },
        "goal": {
            "potential_loads_req_per_s": 35000,
            "potential_loads_p50_ms": 0.4,
            "add_free_req_per_s": 22000,
        },  # fmt: skip
        "results": {},
    }
    targets = [("dynamo-py", sys.executable)]
    if args.reference_python:
        isolate_network()
        targets.append(("reference", args.reference_python))
    services: list[Service] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for label, python in targets:
                services.append(Service(python, label))
            report["results"] = run_all(services, args, Path(tmp))
        finally:
            for svc in services:
                svc.stop()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["results"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

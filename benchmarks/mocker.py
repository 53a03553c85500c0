"""Mocker CPU cost per generated token and per request, at speedup 0, through the TCP plane.

Starts ``python -m dynamo.mocker --speedup-ratio 0`` in a subprocess (file discovery in a temp
directory), drives it with a request-plane client in this process (no HTTP, no frontend), and
reads the worker's CPU seconds from /proc. Prints a table; writes bench-results/mocker.json.

Reference (issue 3): the Rust mocker costs 1.4-1.6 ms CPU per 64-token request on this machine
type. Goal: <= 0.7 ms per 64-token request (<= 10 us per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # also under `python -m benchmarks...`

from launcher import cpu_seconds  # noqa: E402

from dynamo.backend.run import run_async  # noqa: E402
from dynamo.protocol.output import LLMEngineOutput  # noqa: E402
from dynamo.protocol.request import PreprocessedRequest, StopConditions  # noqa: E402
from dynamo.runtime.config import RuntimeConfig  # noqa: E402
from dynamo.runtime.context import Context  # noqa: E402
from dynamo.runtime.naming import EndpointId  # noqa: E402
from dynamo.runtime.runtime import DistributedRuntime  # noqa: E402


async def drive(directory: str, pid: int, isl: int, osl: int, concurrency: int, n: int) -> dict:
    runtime = DistributedRuntime(RuntimeConfig(discovery_backend="file", discovery_dir=directory))
    await runtime.start()
    try:
        client = await runtime.client(EndpointId("dynamo", "backend", "generate"))
        (target,) = await client.wait_for_instances(1, timeout=30)
        enc = msgspec.msgpack.Encoder()
        dec = msgspec.msgpack.Decoder(LLMEngineOutput)

        def body(i: int) -> bytes:
            tokens = [(i * 7919 + j) % 3000 + 10 for j in range(isl)]
            return enc.encode(
                PreprocessedRequest(
                    model="demo",
                    token_ids=tokens,
                    request_id=f"b{i}",
                    stop=StopConditions(max_tokens=osl, ignore_eos=True),
                )
            )

        async def one(i: int) -> int:
            count = 0
            async for raw in client.stream(body(i), Context(), instance_id=target):
                count += len(dec.decode(raw).token_ids)
            if count != osl:
                raise RuntimeError(f"request {i}: {count} tokens, expected {osl}")
            return count

        for i in range(min(50, n)):  # warm-up
            await one(-i - 1)
        queue = list(range(n))
        tokens = 0

        async def lane() -> None:
            nonlocal tokens
            while queue:
                got = await one(queue.pop())
                tokens += got

        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        cpu1, t1 = cpu_seconds(pid), time.perf_counter()
        assert tokens == n * osl, (tokens, n * osl)
        cpu = cpu1 - cpu0
        return {
            "isl": isl,
            "osl": osl,
            "concurrency": concurrency,
            "requests": n,
            "req_per_s": n / (t1 - t0),
            "mocker_cpu_ms_per_request": cpu / n * 1e3,
            "mocker_cpu_us_per_token": cpu / tokens * 1e6,
        }
    finally:
        await runtime.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--out", default=str(REPO / "bench-results" / "mocker.json"))
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="bench-mocker-")
    env = dict(os.environ, DYN_FILE_KV=directory)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo.mocker",
            "--model-path",
            str(REPO / "dynamo/models/demo"),
            "--model-name",
            "demo",
            "--speedup-ratio",
            "0",
            "--log-level",
            "WARNING",
        ],
        env=env,
        cwd=REPO,
    )
    rows = []
    try:
        for c in args.concurrency:
            rows.append(run_async(drive(directory, proc.pid, args.isl, args.osl, c, args.requests)))
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"{'conc':>5} {'req/s':>9} {'CPU ms/req':>11} {'CPU us/token':>13}")
    for r in rows:
        print(
            f"{r['concurrency']:>5} {r['req_per_s']:>9.0f} {r['mocker_cpu_ms_per_request']:>11.3f}"
            f" {r['mocker_cpu_us_per_token']:>13.2f}"
        )
    result = {
        "benchmark": "mocker",
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "goal": "<= 0.7 ms CPU per 64-token request (<= 10 us/token)",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

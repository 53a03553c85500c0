"""The mocker worker's serving path (issue 11): one mocker worker (the real ``Worker`` wiring of
``python -m dynamo.mocker``, speedup 1000 as in the stack benchmark beside the reference) in
this process, serving the TCP request plane on loopback; the client, the frontend's side of
the request plane (``TCPRequestPlaneClient``), runs in a child process so that its CPU is not
counted. ``concurrency`` requests at a time of the stack benchmark's shape: 128 prompt tokens,
64 output tokens, ``ignore_eos``.

Prints the worker process's CPU a request (all its threads; best of ``--rounds``). On a shared
VM that figure moves +-10 % between runs; ``--instructions`` measures instructions a request
instead, which move far less: the script runs its worker twice under ``valgrind
--tool=cachegrind`` (``--requests`` and twice that; the client child runs natively) and divides
the difference by ``--requests`` (start-up and warm-up cancel out). A few minutes; valgrind must
be installed. Use it to A/B a change of the worker's code (``dynamo/backend``, ``dynamo/mocker``,
the request plane's server side).

``--tracing off|local|export`` (issue 17) runs the worker in that tracing mode (``export``: to
an OTLP receiver in a process of its own; the export thread's CPU is the worker's).

    .venv/bin/python -m benchmarks.worker_path
    .venv/bin/python -m benchmarks.worker_path --instructions
    .venv/bin/python -m benchmarks.worker_path --instructions --tracing local
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import uvloop  # noqa: E402

from benchmarks import cachegrind  # noqa: E402
from benchmarks.launcher import TRACING_MODES, tracing_mode  # noqa: E402
from dynamo.observability import tracing  # noqa: E402
from dynamo.protocol.output import LLMEngineOutput  # noqa: E402
from dynamo.protocol.request import PreprocessedRequest, StopConditions  # noqa: E402
from dynamo.runtime.context import Context  # noqa: E402

ISL = 128
OSL = 64
VOCAB = 3_800  # below the demo vocabulary's special ids


def request_body(i: int, traced: bool) -> bytes:
    """Request ``i``; ``traced``: with the ``traceparent`` the frontend sends unless tracing is
    off (the worker's spans continue the frontend's trace)."""
    rng = random.Random(i)
    request = PreprocessedRequest(
        model="demo",
        token_ids=[rng.randrange(VOCAB) for _ in range(ISL)],
        request_id=f"req-{i}",
        stop=StopConditions(max_tokens=OSL, ignore_eos=True),
        traceparent=f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"
        if traced
        else None,
    )
    return msgspec.msgpack.encode(request)


async def client(address: str, path: str, concurrency: int, requests: int) -> None:
    """The child: a warm-up, then a round of ``requests`` per ``go`` line on stdin."""
    from dynamo.runtime.request_plane.tcp_client import TCPRequestPlaneClient

    rp = TCPRequestPlaneClient()
    decode = msgspec.msgpack.Decoder(LLMEngineOutput).decode
    traced = not tracing.sdk_disabled()  # as the frontend: a traceparent unless tracing is off
    bodies = [request_body(i, traced) for i in range(256)]
    gate = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()
    frames = [0]

    async def one(i: int) -> None:
        async with gate:
            tokens = 0
            last = None
            async for batch in rp.stream_batches(address, path, bodies[i % 256], Context()):
                frames[0] += len(batch)
                for raw in batch:
                    last = decode(raw)
                    tokens += len(last.token_ids)
            if last is None or last.finish_reason is None or tokens != OSL:
                raise RuntimeError(f"request {i}: {tokens} tokens, last chunk {last!r}")

    try:
        await asyncio.gather(*(one(i) for i in range(4 * concurrency)))
        print("warm", flush=True)
        while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "go":
            frames[0] = 0
            await asyncio.gather(*(one(i) for i in range(requests)))
            print(f"done {frames[0] / requests:.1f}", flush=True)
    finally:
        await rp.close()


async def serve(requests: int, concurrency: int, rounds: int) -> tuple[float, float]:
    """Run the worker, drive it from the child: the worker's CPU seconds a request (best
    round) and the response frames a request (last round)."""
    from dynamo.mocker.__main__ import build_parser, build_worker, mocker_config
    from dynamo.preprocess import demo_model_path
    from dynamo.runtime.config import RuntimeConfig
    from dynamo.runtime.runtime import InProcessHub

    flags = ["--model-path", str(demo_model_path()), "--model-name", "demo"]
    args = build_parser().parse_args([*flags, "--speedup-ratio", "1000"])
    runtime = RuntimeConfig(discovery_backend="memory", request_plane="tcp", event_plane="zmq")
    worker = build_worker(
        mocker_config(args), runtime, hub=InProcessHub(), install_signal_handlers=False
    )
    task = asyncio.create_task(worker.run())
    child: asyncio.subprocess.Process | None = None
    try:
        await asyncio.wait_for(worker.ready.wait(), 600)
        address = (await worker.runtime.server()).address
        path = worker.config.endpoint_id().instance_path(worker.worker_ids[0])
        cmd = ["-m", "benchmarks.worker_path", "--client", address, path]
        cmd += ["--requests", str(requests), "--concurrency", str(concurrency)]
        child = await asyncio.create_subprocess_exec(
            _native_python(), *cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert child.stdin is not None and child.stdout is not None
        await _expect(child, "warm")
        best, frames = float("inf"), 0.0
        for _ in range(rounds):
            began = time.process_time()
            child.stdin.write(b"go\n")
            frames = float(await _expect(child, "done"))
            best = min(best, time.process_time() - began)
        child.stdin.write(b"stop\n")
        await child.wait()
        return best / requests, frames
    finally:
        if child is not None and child.returncode is None:
            child.kill()
            await child.wait()
        worker.request_shutdown()
        await task


def _native_python() -> str:
    """This interpreter (under valgrind, ``sys.executable`` is still the Python binary)."""
    return sys.executable


async def _expect(child: asyncio.subprocess.Process, word: str) -> str:
    """The child's next line, which must start with ``word``; what follows it."""
    assert child.stdout is not None
    line = (await child.stdout.readline()).decode().strip()
    said, _, rest = line.partition(" ")
    if said != word:
        raise RuntimeError(f"the client said {line!r} (exit {child.returncode}), not {word!r}")
    return rest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="a round's requests")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--instructions", action="store_true", help="count under valgrind")
    parser.add_argument(
        "--tracing",
        choices=TRACING_MODES,
        help="issue 17's tracing mode (default: the environment's settings)",
    )
    parser.add_argument("--client", nargs=2, metavar=("ADDRESS", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tracing is None:
        return run(args)
    with tracing_mode(args.tracing):
        return run(args)


def run(args: argparse.Namespace) -> int:
    if args.client:
        uvloop.run(client(*args.client, args.concurrency, args.requests))
        return 0
    if args.instructions:
        per = cachegrind.per_request(
            "benchmarks.worker_path",
            min(args.requests, 1000),
            ["--concurrency", str(args.concurrency), "--rounds", "1"],
            echo=True,
        )
        c = args.concurrency
        mode = f", tracing {args.tracing}" if args.tracing else ""
        print(f"mocker worker serving path, c={c}{mode}: {per / 1e6:.3f} M instructions a request")
        return 0
    cpu, frames = uvloop.run(serve(args.requests, args.concurrency, args.rounds))
    load = os.getloadavg()[0]
    print(
        f"mocker worker serving path, c={args.concurrency}: {cpu * 1e6:.1f} us of the worker's "
        f"CPU a request (best of {args.rounds} x {args.requests}; {frames:.1f} frames a "
        f"request; load {load:.1f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The worker's tracing work a request, counted deterministically (issue 17): the request
plane's handler (``EngineAdapter.handle``: the request decoded, its ``handle_payload`` and
``engine.generate`` spans, the chunks encoded) over a scripted engine that answers every
request with the mocker's c=64 shape (64 tokens in four frames, as
``benchmarks/frontend_path.py``'s worker), ``concurrency`` requests at a time, in one process,
without the request plane's sockets or the mocker's scheduler.

Why: ``benchmarks/worker_path.py --instructions`` counts the whole serving path, but under
valgrind the mocker's frames a request vary between runs (one per token or batched, 60-64),
and each frame costs more than the spans' difference between modes. Here the frames are fixed,
so the difference between ``--tracing off``, ``local`` and ``export`` is what the spans cost
(``export``: recorded, the per-chunk inter-token timing, the OTLP encoding and the sending on
the export thread, to a receiver in a process of its own); compare it with the worker path's
instructions a request. The requests carry a ``traceparent`` unless tracing is off, as the
frontend's do.

    .venv/bin/python -m benchmarks.worker_spans --instructions --tracing off
    .venv/bin/python -m benchmarks.worker_spans --instructions --tracing export
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import uvloop  # noqa: E402

from benchmarks import cachegrind  # noqa: E402
from benchmarks.launcher import TRACING_MODES, tracing_mode  # noqa: E402
from benchmarks.worker_path import request_body  # noqa: E402
from dynamo.backend.adapter import EngineAdapter  # noqa: E402
from dynamo.backend.engine import EngineConfig, LLMEngine, chunk, with_usage  # noqa: E402
from dynamo.observability import tracing  # noqa: E402
from dynamo.protocol.output import LLMEngineOutput  # noqa: E402
from dynamo.protocol.request import PreprocessedRequest  # noqa: E402
from dynamo.runtime.context import Context  # noqa: E402

OSL = 64
FRAMES = ((0, 1), (1, 22), (22, 43))  # then the terminal with the rest (43:64) and usage


class ScriptedEngine(LLMEngine):
    """Every request: ``OSL`` tokens in the mocker's c=64 framing, one frame per resumption."""

    async def start(self, worker_id: int) -> EngineConfig:
        # what a served copy would register (this benchmark drives the adapter directly)
        return EngineConfig(model="scripted", kv_events=False)

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        ids = request.token_ids[:OSL]
        for start, end in FRAMES:
            await asyncio.sleep(0)
            yield chunk.tokens(ids[start:end])
        await asyncio.sleep(0)
        out = with_usage(chunk.length(), len(request.token_ids), OSL)
        out.token_ids = ids[FRAMES[-1][1] :]
        yield out

    async def cleanup(self) -> None:
        return None


async def measure(requests: int, concurrency: int) -> float:
    """The process's CPU seconds a request (after a warm-up; with the export thread's final
    send)."""
    tracing.setup_tracing("worker-spans")
    adapter = EngineAdapter(ScriptedEngine())
    traced = not tracing.sdk_disabled()
    bodies = [request_body(i, traced) for i in range(256)]
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            sent = 0
            async for frame in adapter.handle(bodies[i % len(bodies)], Context()):
                sent += len(frame)
            if not sent:
                raise RuntimeError(f"request {i}: nothing sent")

    await asyncio.gather(*(one(i) for i in range(4 * concurrency)))  # warm-up
    began = time.process_time()
    await asyncio.gather(*(one(i) for i in range(requests)))
    tracing.shutdown_tracing()  # the export thread sends what is queued (the warm-up's too)
    return (time.process_time() - began) / requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--instructions", action="store_true", help="count under valgrind")
    parser.add_argument("--tracing", choices=TRACING_MODES, default="local")
    args = parser.parse_args()
    with tracing_mode(args.tracing):
        if args.instructions:
            per = cachegrind.per_request(
                "benchmarks.worker_spans",
                min(args.requests, 2000),
                ["--concurrency", str(args.concurrency), "--tracing", args.tracing],
            )
            print(
                f"worker handler, tracing {args.tracing}: {per / 1e3:.1f} k instructions a request"
            )
            return 0
        cpu = uvloop.run(measure(args.requests, args.concurrency))
    print(f"worker handler, tracing {args.tracing}: {cpu * 1e6:.1f} us of CPU a request")
    return 0


if __name__ == "__main__":
    sys.exit(main())

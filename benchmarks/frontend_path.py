"""The frontend's request path in one process (issue 11): the chat handler over the handler
tests' fakes (``tests/unit/frontend/handler_kit.py``: a fake HTTP exchange, a scripted worker
in place of the request plane), tokenization in the tokenizer process as the frontend does it,
uvloop, ``concurrency`` requests at a time. The worker answers like the mocker at c=64 in the
stack benchmark: a 64-token stream in four frames (the first token alone, then three of 21),
random ids of the demo vocabulary (about one in ten a byte of a multi-byte character).

Prints the event loop thread's CPU a request (best of ``--rounds``; the handler, the
preprocessing, the per-frame path, the fakes' own small share). On a shared VM that figure
moves +-10 % between runs; ``--instructions`` measures instructions a request instead, which
do not move: the script runs itself twice under ``valgrind --tool=cachegrind`` (``--requests``
and twice that) and divides the difference by ``--requests`` (start-up cancels out). About a
minute and a half; valgrind must be installed. Use it to A/B a change of the frontend's code.

``--tracing off|local|export`` (issue 17) runs it in that tracing mode (``export``: to an OTLP
receiver in a process of its own); compare the modes with ``--instructions``, which counts the
whole process (the export thread too), where the loop-thread CPU leaves the export thread out.

    .venv/bin/python -m benchmarks.frontend_path
    .venv/bin/python -m benchmarks.frontend_path --instructions
    .venv/bin/python -m benchmarks.frontend_path --instructions --tracing export
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import uvloop  # noqa: E402

from benchmarks import cachegrind  # noqa: E402
from benchmarks.launcher import TRACING_MODES, tracing_mode  # noqa: E402
from dynamo.backend.engine import chunk, with_usage  # noqa: E402
from dynamo.frontend.attempt import Timeouts  # noqa: E402
from dynamo.frontend.offload import Offload  # noqa: E402
from dynamo.protocol.output import LLMEngineOutput  # noqa: E402
from dynamo.runtime.context import Context  # noqa: E402
from dynamo.runtime.heap import settle_after_start  # noqa: E402
from tests.fakes import FakeExchange  # noqa: E402
from tests.unit.frontend import handler_kit  # noqa: E402

OSL = 64
FRAMES = ((0, 1), (1, 22), (22, 43))  # then the terminal with the rest (43:64) and usage
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho".split()


class MockerShapedWorker(handler_kit.ScriptedWorker):
    """Answers every request with ``OSL`` random ids in the mocker's c=64 framing."""

    rng = random.Random(64)

    async def _run(
        self, ctx: Context, skip: int = 0, failing: bool = True
    ) -> AsyncGenerator[list[bytes], None]:
        vocab = handler_kit.PRE.tokenizer.vocab_size
        # below the special ids (the demo's last 16), as the mocker samples
        ids = [self.rng.randrange(vocab - 256) for _ in range(OSL)]
        for start, end in FRAMES:
            await asyncio.sleep(0)
            yield [handler_kit._enc.encode(LLMEngineOutput(token_ids=ids[start:end]))]
        await asyncio.sleep(0)
        out = with_usage(chunk.length(), 128, OSL)
        out.token_ids = ids[FRAMES[-1][1] :]
        yield [handler_kit._enc.encode(out)]


def body(i: int) -> bytes:
    rng = random.Random(i)
    content = " ".join(rng.choice(WORDS) for _ in range(118))  # ~128 prompt tokens in all
    return json.dumps(
        {
            "model": "demo",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": OSL,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
    ).encode()


async def measure(requests: int, concurrency: int, rounds: int) -> float:
    """The loop thread's CPU seconds a request, best of ``rounds`` (after a warm-up)."""
    kit = handler_kit.make_kit(
        max_inflight=4 * concurrency,
        offload=Offload(tokenize_in="process"),
        timeouts=Timeouts(600.0, 600.0),  # under valgrind a first response takes seconds
    )
    kit.worker.__class__ = MockerShapedWorker
    settle_after_start()  # the frontend's collector settings
    bodies = [body(i) for i in range(256)]
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            http = FakeExchange(bodies[i % len(bodies)])
            await kit.handler.chat(http)
            if http.status != 200:
                raise RuntimeError(f"status {http.status}: {http.response!r}")

    try:
        await asyncio.gather(*(one(i) for i in range(4 * concurrency)))  # warm-up
        best = float("inf")
        for _ in range(rounds):
            began = time.thread_time()
            await asyncio.gather(*(one(i) for i in range(requests)))
            best = min(best, time.thread_time() - began)
        return best / requests
    finally:
        kit.handler.offload.close()


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
    args = parser.parse_args()
    if args.tracing is None:
        return run(args)
    with tracing_mode(args.tracing):
        return run(args)


def run(args: argparse.Namespace) -> int:
    if args.instructions:
        per = cachegrind.per_request(
            "benchmarks.frontend_path",
            min(args.requests, 1000),
            ["--concurrency", str(args.concurrency), "--rounds", "1"],
        )
        c = args.concurrency
        mode = f", tracing {args.tracing}" if args.tracing else ""
        print(f"frontend request path, c={c}{mode}: {per / 1e6:.3f} M instructions a request")
        return 0
    cpu = uvloop.run(measure(args.requests, args.concurrency, args.rounds))
    load = os.getloadavg()[0]
    print(
        f"frontend request path, c={args.concurrency}: {cpu * 1e6:.1f} us of loop-thread CPU a "
        f"request (best of {args.rounds} x {args.requests}; load {load:.1f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

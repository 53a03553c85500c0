"""CPU per scheduler pass: the engine core alone (``MockerScheduler.step``, one DP rank), on the
offline replay's shape (prompts of 16 prefix groups of 1024 + 128 tokens, OSL 32, 512 blocks of
16), with the native pass (``engine_core/_pass.c``) and its Python twin side by side.

    python -m benchmarks.scheduler_pass                  # 20,000 passes each
    python -m benchmarks.scheduler_pass --passes 50000 --concurrency 8 --native-only

A closed loop keeps ``--concurrency`` requests on the rank (a finished one is replaced at once,
as the replay's 32 clients spread over 4 workers do). The figure is CPU microseconds per pass
(``time.process_time`` around the passes and the admissions they cause, which hash each
prompt as the live mocker does; prompts are built before): per-unit CPU is the robust figure
on a shared, loaded machine. The collector is settled as in the services. Both implementations
run the same requests and must produce the same tokens (checked).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from types import ModuleType
from typing import Any

from dynamo.engine_core import _pass_fallback, pass_kernels, scheduler
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.simulator import MockerScheduler
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.runtime.heap import settle_after_start

PREFIX, SUFFIX, OSL, GROUPS = 1024, 128, 32, 16
ENGINE = MockerConfig(num_gpu_blocks=512, block_size=16, speedup_ratio=1.0)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    groups = [[rng.randrange(1000, 30000) for _ in range(PREFIX)] for _ in range(GROUPS)]
    return [
        rng.choice(groups) + [rng.randrange(1000, 30000) for _ in range(SUFFIX)]
        for _ in range(count)
    ]


def run(impl: ModuleType | None, passes: int, concurrency: int, seed: int) -> dict[str, Any]:
    """``passes`` passes with ``impl``'s kernels (None: the one ``pass_kernels`` chose)."""
    original = scheduler.mock_pass
    if impl is not None:
        scheduler.mock_pass = impl.mock_pass  # type: ignore[assignment]
    try:
        sched = MockerScheduler(ENGINE)
        pool = prompts(passes // 4 + concurrency, seed)
        sent = 0

        def send() -> None:
            nonlocal sent
            request = PreprocessedRequest(
                model="m",
                token_ids=pool[sent % len(pool)],
                stop=StopConditions(max_tokens=OSL, ignore_eos=True),
            )
            sched.add_request(request, f"r{sent}", 0.0)
            sent += 1

        for _ in range(concurrency):
            send()
        now, tokens, digest = 0.0, 0, 0
        cpu = time.process_time()
        for _ in range(passes):
            out = sched.step(now)
            now += out.duration
            tokens += len(out.tokens)
            for _seq, token in out.tokens:
                digest = (digest * 31 + token) & 0xFFFFFFFF
            for _ in out.finished:
                send()
        cpu = time.process_time() - cpu
    finally:
        scheduler.mock_pass = original  # type: ignore[assignment]
    return {
        "cpu_us_per_pass": cpu / passes * 1e6,
        "cpu_s": cpu,
        "passes": passes,
        "requests_finished": sent - concurrency,
        "tokens": tokens,
        "digest": digest,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--native-only", action="store_true", help="skip the Python twin's run")
    args = p.parse_args()
    settle_after_start()  # the collector as the mocker's and the replay's processes have it
    native = run(None, args.passes, args.concurrency, args.seed)
    print(f"native {pass_kernels.IMPLEMENTATION}: {json.dumps(native)}")
    if args.native_only:
        return 0
    python = run(_pass_fallback, args.passes, args.concurrency, args.seed)
    print(f"python fallback: {json.dumps(python)}")
    if native["digest"] != python["digest"] or native["tokens"] != python["tokens"]:
        print("MISMATCH: the two implementations produced different tokens")
        return 1
    print(f"native / python CPU per pass: {native['cpu_s'] / python['cpu_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

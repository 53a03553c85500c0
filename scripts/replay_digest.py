"""sha256 of the replay's records and routing rows over 19 deployment shapes: the check that a
change to the replay's engine or router code left every result byte-identical.

    python scripts/replay_digest.py [NAME ...]        # all shapes, or the named ones
    DYN_NATIVE=0 python scripts/replay_digest.py      # the pure-Python twins: same digest
    python scripts/replay_digest.py --extra           # 9 more shapes (router queue, timeouts,
                                                      # warm-up, 100 workers, 3P2D): own TOTAL

Prints one short digest per shape and the TOTAL over all of them; compare TOTAL before and after
a change (docs/performance.md, "Offline replay", records the digests of main).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's dynamo

import msgspec  # noqa: E402

from dynamo.bench.config import BenchConfig  # noqa: E402
from dynamo.frontend.disagg import DisaggSettings  # noqa: E402
from dynamo.mocker.config import MockerConfig  # noqa: E402
from dynamo.replay.deployment import Deployment  # noqa: E402
from dynamo.replay.report import routing_rows  # noqa: E402
from dynamo.replay.run import run_replay  # noqa: E402
from dynamo.router.config import KVRouterSettings as K  # noqa: E402

E = MockerConfig(num_gpu_blocks=512, block_size=16, speedup_ratio=1.0)


def engine(**changes: object) -> MockerConfig:
    return dataclasses.replace(E, **changes)  # type: ignore[arg-type]


def bench(**changes: object) -> BenchConfig:
    base: dict[str, object] = dict(
        url="replay:",
        workload="prefix",
        prefix_groups=8,
        prefix_len=512,
        suffix_len=64,
        osl=16,
        concurrency=16,
        num_requests=160,
        seed=3,
    )
    base.update(changes)
    return BenchConfig(**base)  # type: ignore[arg-type]


CASES: dict[str, tuple[BenchConfig, Deployment]] = {
    "kv4": (bench(), Deployment(4, "kv", engine=E)),
    "rr": (bench(), Deployment(4, "round-robin", engine=E)),
    "random": (bench(), Deployment(4, "random", engine=E)),
    "dp2": (bench(), Deployment(2, "kv", engine=engine(data_parallel_size=2))),
    "preempt": (
        bench(osl=200, num_requests=60),
        Deployment(2, "kv", engine=engine(num_gpu_blocks=160)),
    ),
    "disagg": (
        bench(),
        Deployment(
            2,
            "kv",
            engine=E,
            prefill_workers=2,
            disagg=DisaggSettings(max_local_prefill_length=100),
        ),
    ),
    "open30": (bench(rate=30.0), Deployment(4, "kv", engine=E)),
    "bs64": (bench(), Deployment(4, "kv", engine=engine(block_size=64))),
    "multiturn": (
        bench(workload="multi-turn", turns=3, isl=300, osl=20, num_requests=90),
        Deployment(3, "kv", engine=E),
    ),
    "chunked": (
        bench(workload="synthetic", isl=3000, osl=8, num_requests=40, concurrency=8),
        Deployment(2, "kv", engine=engine(num_gpu_blocks=2048, max_num_batched_tokens=1024)),
    ),
    "temp": (bench(), Deployment(4, "kv", kv=K(temperature=0.5), engine=E)),
    "decay": (
        bench(),
        Deployment(
            4,
            "kv",
            kv=K(overlap_score_credit_decay=0.5, decode_active_request_weight=0.3),
            engine=E,
        ),
    ),
    "notrack": (bench(), Deployment(4, "kv", kv=K(track_active_blocks=False), engine=E)),
    "approx": (bench(), Deployment(4, "kv", kv=K(use_kv_events=False), engine=E)),
    "noreuse": (bench(), Deployment(4, "kv", kv=K(assume_kv_reuse=False), engine=E)),
    "busy": (
        bench(),
        Deployment(
            4,
            "kv",
            kv=K(active_decode_blocks_threshold=0.15, active_prefill_tokens_threshold=1200),
            engine=E,
        ),
    ),
    "weights": (
        bench(),
        Deployment(4, "kv", kv=K(overlap_score_weight=2.0, overlap_score_credit=0.5), engine=E),
    ),
    "nocache": (bench(), Deployment(4, "kv", engine=engine(enable_prefix_caching=False))),
    "big": (
        bench(
            num_requests=600,
            concurrency=32,
            prefix_groups=16,
            prefix_len=1024,
            suffix_len=128,
            osl=32,
        ),
        Deployment(4, "kv", engine=E),
    ),
}


QUEUE_LOAD = dict(rate=300.0, num_requests=120, prefix_len=2048, suffix_len=128, osl=24)
EXTRA: dict[str, tuple[BenchConfig, Deployment]] = {
    "q-fcfs": (
        bench(**QUEUE_LOAD),
        Deployment(4, "kv", kv=K(queue_threshold=0.5, queue_max_requests=5), engine=E),
    ),
    "q-wspt": (
        bench(**QUEUE_LOAD),
        Deployment(
            4, "kv", kv=K(queue_threshold=0.5, queue_policy="wspt", queue_max_requests=5), engine=E
        ),
    ),
    "q-none": (bench(**QUEUE_LOAD), Deployment(4, "kv", engine=E)),
    "timeout": (
        bench(rate=200.0, max_concurrency=12, request_timeout_s=2.2, osl=64, num_requests=120),
        Deployment(2, "kv", engine=engine(num_gpu_blocks=256)),
    ),
    "warmup": (bench(warmup=40, isl=700), Deployment(4, "kv", engine=E)),
    "w100": (
        bench(num_requests=300, concurrency=64, osl=24),
        Deployment(100, "kv", engine=E),
    ),
    "3p2d": (
        bench(num_requests=200),
        Deployment(
            2,
            "kv",
            engine=E,
            prefill_workers=3,
            disagg=DisaggSettings(max_local_prefill_length=64),
        ),
    ),
    "dp4-rr": (bench(), Deployment(2, "round-robin", engine=engine(data_parallel_size=4))),
    "speed0": (bench(), Deployment(4, "kv", engine=engine(speedup_ratio=0.0))),
}


def main(only: list[str]) -> None:
    total = hashlib.sha256()
    cases = CASES
    if only[:1] == ["--extra"]:
        cases, only = EXTRA, only[1:]
    for name, (config, deployment) in cases.items():
        if only and name not in only:
            continue
        result = run_replay(config, deployment, plots=False)
        h = hashlib.sha256()
        for record in result.records:
            h.update(msgspec.json.encode(record))
        for row in routing_rows(result.flights):
            h.update(msgspec.json.encode(row))
        h.update(repr(result.simulation.simulated_s).encode())
        total.update(h.digest())
        hit = result.summary.get("cache_hit_rate")
        print(f"{name:10s} {h.hexdigest()[:16]} n={len(result.records)} hit={hit}")
    print("TOTAL", total.hexdigest())


if __name__ == "__main__":
    main(sys.argv[1:])

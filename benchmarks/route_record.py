"""The KV router's per-request load accounting alone: ``RoutingCore.route`` (recorded) +
``prefill_completed`` + ``free`` on a warm 4-worker router, prompts of the offline replay's
shape (16 prefix groups of 1,024 tokens + 128 own tokens, blocks of 16), 32 in flight.

    python -m benchmarks.route_record --requests 20000          # CPU time a request
    python -c "from benchmarks.cachegrind import per_request; \\
        print(per_request('benchmarks.route_record', 2000, []))"  # instructions a request

The instruction count is the figure to compare (deterministic whatever the VM's load).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque

from dynamo.protocol.kv_events import BlocksStored, StoredBlock
from dynamo.router.config import KVRouterSettings
from dynamo.router.core import RoutingCore, WorkerSpec
from dynamo.router.hashing import local_block_hashes, sequence_hashes

BLOCK, GROUPS, PREFIX, OWN, WORKERS, IN_FLIGHT = 16, 16, 1024, 128, 4, 32


def setup() -> tuple[RoutingCore, list[tuple[list[int], list[int], list[int]]]]:
    """A router whose index holds each group's prefix on one worker, and 200 prompts."""
    rng = random.Random(1)
    core = RoutingCore(BLOCK, KVRouterSettings(), rng=random.Random(2))
    for w in range(WORKERS):
        core.add_worker(WorkerSpec(100 + w, 0, 1, 512, 8192))
    groups = [[rng.randrange(50_000) for _ in range(PREFIX)] for _ in range(GROUPS)]
    assert core.indexer is not None
    for g, tokens in enumerate(groups):
        local = local_block_hashes(tokens, BLOCK)
        blocks = [StoredBlock(s, h) for s, h in zip(sequence_hashes(local), local, strict=True)]
        core.indexer.apply_data(100 + g % WORKERS, 0, BlocksStored(parent_hash=None, blocks=blocks))
    prompts = []
    for i in range(200):
        tokens = groups[i % GROUPS] + [rng.randrange(50_000) for _ in range(OWN)]
        local = local_block_hashes(tokens, BLOCK)
        prompts.append((tokens, local, sequence_hashes(local)))
    return core, prompts


def run(
    core: RoutingCore, prompts: list[tuple[list[int], list[int], list[int]]], n: int, name: str
) -> None:
    live: deque[str] = deque()
    for i in range(n):
        tokens, local, seqs = prompts[i % len(prompts)]
        request_id = f"{name}-{i}"
        core.route(request_id, local, len(tokens), seq_hashes=seqs)
        live.append(request_id)
        core.prefill_completed(request_id)
        if len(live) > IN_FLIGHT:
            core.free(live.popleft())
    while live:
        core.free(live.popleft())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    args = parser.parse_args()
    core, prompts = setup()
    run(core, prompts, IN_FLIGHT, "warm")  # warm: the route recorder is built on the first request
    cpu = time.process_time()
    run(core, prompts, args.requests, "r")
    cpu = time.process_time() - cpu
    print(f"route + prefill_completed + free: {cpu / max(args.requests, 1) * 1e6:.2f} µs CPU")


if __name__ == "__main__":
    main()

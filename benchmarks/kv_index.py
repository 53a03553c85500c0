"""KV index microbenchmark: store cost per block and find_matches cost per block matched.

8 workers; 64-block sequences under a shared 16-block prefix; ~50,000 blocks stored through stored
events (one 16-block prefix event per worker, then 48-block events under it), then 2,000
find_matches of 64 blocks. Reference (Rust index called from Python): 0.3-0.45 µs per stored block,
0.15-0.25 µs per block matched. Writes bench-results/kv_index.json.

    .venv/bin/python benchmarks/kv_index.py [--reps 7] [--out bench-results/kv_index.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from dynamo.protocol.kv_events import BlocksStored, KVCacheEvent, KVEventBatch, StoredBlock
from dynamo.protocol.kv_wire import decode_batch, encode_batch
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.router.indexer import EventStatus, KVIndexer

BLOCK_SIZE = 16
PREFIX_BLOCKS = 16
SEQ_BLOCKS = 64
REF_STORE_US = (0.30, 0.45)
REF_MATCH_US = (0.15, 0.25)


def build(
    workers: int, target_blocks: int, seed: int
) -> tuple[list[tuple[int, KVCacheEvent]], list[list[int]], int]:
    """Events in arrival order (workers interleaved) and every stored sequence's local hashes."""
    rng = random.Random(seed)
    prefix_tokens = [rng.randrange(32000) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
    suffix_blocks = SEQ_BLOCKS - PREFIX_BLOCKS
    per_worker = max(1, (target_blocks - workers * PREFIX_BLOCKS) // (workers * suffix_blocks))
    per_worker_events: list[list[KVCacheEvent]] = []
    sequences: list[list[int]] = []
    total = 0
    for _ in range(workers):
        events: list[KVCacheEvent] = []
        for i in range(per_worker):
            tokens = prefix_tokens + [
                rng.randrange(32000) for _ in range(suffix_blocks * BLOCK_SIZE)
            ]
            local = local_block_hashes(tokens, BLOCK_SIZE)
            ext = sequence_hashes(local)  # engines' block ids: chained hashes, as vLLM's
            sequences.append(local)
            if i == 0:
                events.append(_stored(len(events), None, ext[:PREFIX_BLOCKS], local))
                total += PREFIX_BLOCKS
            parent = ext[PREFIX_BLOCKS - 1]
            events.append(_stored(len(events), parent, ext[PREFIX_BLOCKS:], local[PREFIX_BLOCKS:]))
            total += suffix_blocks
        per_worker_events.append(events)
    arrival = [
        (w, ev)
        for step in range(per_worker + 1)
        for w, events in enumerate(per_worker_events)
        if step < len(events)
        for ev in (events[step],)
    ]
    return arrival, sequences, total


def _stored(eid: int, parent: int | None, ext: list[int], local: list[int]) -> KVCacheEvent:
    blocks = [StoredBlock(b, h) for b, h in zip(ext, local, strict=False)]
    return KVCacheEvent(event_id=eid, data=BlocksStored(parent_hash=parent, blocks=blocks))


def run_once(
    arrival: list[tuple[int, KVCacheEvent]],
    wire: list[tuple[int, bytes]],
    queries: list[list[int]],
    total_blocks: int,
) -> dict[str, float]:
    index = KVIndexer()
    t0 = time.perf_counter()
    for w, ev in arrival:
        index.apply(w, ev)
    t1 = time.perf_counter()
    if index.counters[EventStatus.OK] != len(arrival):
        raise RuntimeError(f"events not applied cleanly: {index.counters}")
    matched = 0
    t2 = time.perf_counter()
    for q in queries:
        matched += max(index.find_matches(q).values())
    t3 = time.perf_counter()
    if matched != len(queries) * SEQ_BLOCKS:
        raise RuntimeError("a query did not match its full sequence")
    # the router's real path: a kv-events message (FACTS §2.1 wire shape) -> decode -> apply
    index2 = KVIndexer()
    t4 = time.perf_counter()
    for _, payload in wire:
        batch = decode_batch(payload)
        assert batch is not None
        index2.apply_batch(batch)
    t5 = time.perf_counter()
    return {
        "store_us_per_block": (t1 - t0) / total_blocks * 1e6,
        "match_us_per_block": (t3 - t2) / matched * 1e6,
        "match_us_per_call": (t3 - t2) / len(queries) * 1e6,
        "decode_and_store_us_per_block": (t5 - t4) / total_blocks * 1e6,
        "nodes": float(index.num_nodes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=50_000)
    ap.add_argument("--queries", type=int, default=2_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-results/kv_index.json"))
    args = ap.parse_args()

    arrival, sequences, total = build(args.workers, args.blocks, args.seed)
    rng = random.Random(args.seed + 1)
    queries = [rng.choice(sequences) for _ in range(args.queries)]
    wire = [(w, encode_batch(KVEventBatch(worker_id=w, events=[ev]))) for w, ev in arrival]
    runs = [run_once(arrival, wire, queries, total) for _ in range(args.reps)]

    def summary(name: str) -> dict[str, float]:
        vals = [r[name] for r in runs]
        return {"best": round(min(vals), 4), "median": round(statistics.median(vals), 4)}

    result = {
        "benchmark": "kv_index",
        "date": time.strftime("%Y-%m-%d"),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "workers": args.workers,
        "blocks_stored": total,
        "events": len(arrival),
        "nodes": int(runs[0]["nodes"]),
        "queries": args.queries,
        "query_blocks": SEQ_BLOCKS,
        "reps": args.reps,
        "store_us_per_block": summary("store_us_per_block"),
        "match_us_per_block": summary("match_us_per_block"),
        "match_us_per_call": summary("match_us_per_call"),
        "decode_and_store_us_per_block": summary("decode_and_store_us_per_block"),
        "reference_store_us_per_block": list(REF_STORE_US),
        "reference_match_us_per_block": list(REF_MATCH_US),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""``ActiveSequences.check_invariants``: every per-rank figure recomputed from the requests
(tests and debugging; kept apart from the accounting it checks)."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynamo.router.sequences import ActiveSequences


def check_sequences(seqs: ActiveSequences) -> None:
    """Raise AssertionError where ``seqs``' ranks, requests or load columns disagree."""
    expected: dict[int, tuple[dict[int, int], int, int, int]] = {
        id(rank): ({}, 0, 0, 0) for rank in seqs._rank_list
    }
    if len(seqs._ranks) != len(seqs._rank_list):
        raise AssertionError("rank index and rank list disagree")
    for key, rank in seqs._ranks.items():
        if key != (rank.worker_id, rank.dp_rank) or id(rank) not in expected:
            raise AssertionError(f"rank index corrupt at {key}")
    last = float("-inf")
    for request_id, req in seqs._requests.items():
        if id(req.rank) not in expected:
            raise AssertionError(f"request {request_id!r} on an untracked rank")
        if req.started_at < last:
            raise AssertionError("requests are not in arrival order")
        last = req.started_at
        if req.prefill_tokens < 0 or (seqs._assume_kv_reuse and req.private_blocks):
            raise AssertionError(f"request {request_id!r} has bad counters")
        blocks, prefill, private, count = expected[id(req.rank)]
        if len(req.keys) % 8 or (req.keys and not seqs._assume_kv_reuse):
            raise AssertionError(f"request {request_id!r} has bad prefix keys")
        for node in array("Q", req.keys):
            blocks[node] = blocks.get(node, 0) + 1
        expected[id(req.rank)] = (
            blocks,
            prefill + req.prefill_tokens,
            private + req.private_blocks,
            count + 1,
        )
    for rank in seqs._rank_list:
        blocks, prefill, private, count = expected[id(rank)]
        held = dict(rank.blocks.items())
        actual = (held, rank.prefill_tokens, rank.private_blocks, rank.num_requests)
        if actual != (blocks, prefill, private, count):
            raise AssertionError(
                f"rank {(rank.worker_id, rank.dp_rank)}: state {actual[1:]} with "
                f"{len(rank.blocks)} blocks, expected {(prefill, private, count)} "
                f"with {len(blocks)} blocks"
            )
    columns = seqs._columns
    for i, rank in enumerate(seqs._rank_list):
        if rank.column != i:
            raise AssertionError(f"rank {(rank.worker_id, rank.dp_rank)} has column {rank.column}")
        if i in seqs._stale:
            continue  # refreshed at the next load_columns
        kept = (columns[0][i], columns[1][i], columns[2][i])
        if kept != (rank.prefill_tokens, len(rank.blocks) + rank.private_blocks, rank.num_requests):
            raise AssertionError(f"rank {(rank.worker_id, rank.dp_rank)}: stale columns {kept}")

"""Pure-Python twin of ``dynamo.router._active`` (contract: ``_active.pyi``): a request's load
into and out of ``ActiveSequences`` (its ``add_routed``, ``mark_prefill_completed`` and ``free``).
Import through ``dynamo.router.sequences``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dynamo.router.block_counts import prefix_key_bytes


def add_routed(
    seqs: Any,
    request_id: str,
    rank: Any,
    sequence_hashes: Sequence[int],
    new_isl_tokens: int,
    overlap_blocks: int,
    prefix_keys: bytes | None,
) -> bool:
    if request_id in seqs._requests:
        return False
    now = seqs._clock()
    if now >= seqs._next_check:
        seqs.expire_stale(now)
    prefill = new_isl_tokens - overlap_blocks * seqs._block_size
    if prefill < 0:
        prefill = 0
    if seqs._assume_kv_reuse:
        keys = prefix_key_bytes(sequence_hashes) if prefix_keys is None else prefix_keys
        rank.blocks.add_prefix_keys(keys)
        private = 0
    else:
        keys = b""
        private = len(sequence_hashes)
        rank.private_blocks += private
    rank.prefill_tokens += prefill
    rank.num_requests += 1
    seqs._stale[rank.column] = rank
    # imported here: sequences imports this module, so importing it first (as its test does)
    # would find sequences partly initialized
    from dynamo.router.sequences import _Request

    seqs._requests[request_id] = _Request(rank, keys, private, prefill, now)
    return True


def mark_prefill_completed(seqs: Any, request_id: str) -> bool:
    req = seqs._requests.get(request_id)
    if req is None:
        return False
    if req.prefill_tokens:
        req.rank.prefill_tokens -= req.prefill_tokens
        req.prefill_tokens = 0
        seqs._stale[req.rank.column] = req.rank
    return True


def free(seqs: Any, request_id: str) -> bool:
    req = seqs._requests.pop(request_id, None)
    if req is None:
        return False
    rank = req.rank
    seqs._stale[rank.column] = rank
    rank.prefill_tokens -= req.prefill_tokens
    rank.num_requests -= 1
    rank.private_blocks -= req.private_blocks
    if req.keys:
        rank.blocks.remove_prefix_keys(req.keys)
    return True

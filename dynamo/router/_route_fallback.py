"""Pure-Python twin of ``dynamo.router._route`` (contract: ``_route.pyi``), used where the
extension is not built or ``DYN_NATIVE=0``. Import through ``dynamo.router.core``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from dynamo.router._cost_fallback import argmin_random_tie, costs


def choose(
    matches: dict[Any, int],
    key_of: list[tuple[int, int]] | None,
    place_of: dict[tuple[int, int], int],
    ranks: Sequence[Any],
    new: list[int],
    isl_tokens: int,
    block_size: int,
    params: tuple[float, float, float, float, bool],
    rng: random.Random,
    track_blocks: bool,
) -> tuple[int, int, list[float]]:
    n = len(ranks)
    if n == 0:
        raise ValueError("choose() needs at least one target")
    if len(new) != n:
        raise ValueError("new must have one item per rank")
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    prefill = [rank.prefill_tokens for rank in ranks]
    requests = [rank.num_requests for rank in ranks]
    decode: Sequence[int]
    if track_blocks:
        decode = [len(rank.blocks) + rank.private_blocks for rank in ranks]
    else:
        decode = new = [0] * n
    overlap = [0] * n
    for match, blocks in matches.items():
        key = match
        if key_of is not None:  # a slot of the index: its key
            if not 0 <= match < len(key_of):
                raise IndexError("a matched slot has no key")
            key = key_of[match]
        place = place_of.get(key)
        if place is None:
            continue  # not a target
        if not 0 <= place < n:
            raise IndexError("a target's place is outside the ranks")
        overlap[place] = blocks
    scores = costs(overlap, prefill, decode, new, requests, isl_tokens, block_size, params)
    chosen = argmin_random_tie(scores, rng)
    return chosen, overlap[chosen], scores

"""Pure-Python twin of ``dynamo.router._cost`` (contract: ``_cost.pyi``), used where the
extension is not built or ``DYN_NATIVE=0``. Import through ``dynamo.router.selector``."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def costs(
    overlap: Sequence[int],
    prefill: Sequence[int],
    decode: Sequence[int],
    new: Sequence[int],
    requests: Sequence[int],
    isl_tokens: int,
    block_size: int,
    params: tuple[float, float, float, float, bool],
) -> list[float]:
    credit_w, scale, request_w, decay_w, track_prefill = params
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    n = len(overlap)
    if not len(prefill) == len(decode) == len(new) == len(requests) == n:
        raise ValueError("every column must have one item per candidate")
    b = float(block_size)
    request_blocks = max(1.0, isl_tokens / b)
    decay_on = decay_w > 0 and track_prefill
    min_prefill = min(prefill) if decay_on and n else 0
    out: list[float] = []
    for i in range(n):
        decay = 1.0
        if decay_on:
            excess = (prefill[i] - min_prefill) / b
            decay = 1.0 / (1.0 + decay_w * excess / request_blocks)
        # (the reference also credits host- and disk-tier hits; there are no such tiers here)
        credit = credit_w * decay * overlap[i]
        load = request_w * requests[i]
        potential = decode[i] + new[i]
        if track_prefill:
            cost = scale * max(0.0, (prefill[i] + isl_tokens) / b - credit) + potential + load
        elif credit_w > 0:  # decode-only router: the credit offsets decode load
            cost = max(0.0, potential - credit) + load
        else:
            cost = potential + load
        out.append(cost)
    return out


def argmin_random_tie(values: Sequence[float], rng: random.Random) -> int:
    best = math.inf
    chosen = 0
    ties = 0
    for i, c in enumerate(values):
        if c < best:
            best, chosen, ties = c, i, 1
        elif c == best:
            ties += 1
            if rng.randrange(ties) == 0:
                chosen = i
    return chosen

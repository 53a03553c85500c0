"""Pure-Python twin of ``dynamo.engine_core._pass`` (contract: ``_pass.pyi``), used where the
extension is not built or ``DYN_NATIVE=0``. Import through ``dynamo.engine_core.pass_kernels``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynamo.engine_core.sequence import Sequence

_LCG_MUL = 6364136223846793005  # Knuth's MMIX 64-bit LCG: cheap, plenty for mock ids
_LCG_INC = 1442695040888963407
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def sample_tokens(
    entries: list[tuple[Sequence, int]], vocab_size: int, excluded: frozenset[int]
) -> list[int | None]:
    vocab = vocab_size
    out: list[int | None] = []
    append = out.append
    for seq, n in entries:
        position = len(seq.tokens)
        if seq.num_computed_tokens + n < position:
            append(None)
            continue
        # SplitMix64's finalizer: a well-spread 64-bit state from (seed, position)
        z = (seq.rng_state + _GOLDEN * (position + 1)) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
        banned = seq.banned_token_ids
        while True:
            token = ((state >> 32) * vocab) >> 32
            if token not in excluded and token not in banned:
                break
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
        append(token)
    return out


def advance(
    entries: list[tuple[Sequence, int]],
    sampled: list[int | None],
    block_size: int,
    caching: bool,
    running: Any,
    finished_status: Any,
    length: Any,
    stop: Any,
    promote: Callable[[Sequence], object],
    hash_fn: Callable[[bytes, int], int],
) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
    # hash_fn: the native loop hashes completed blocks with it; here Sequence.append_token does
    # (the same function, through router.hashing)
    if len(entries) != len(sampled):
        raise ValueError("sampled must have one item per batch entry")
    bs = block_size
    tokens_out: list[tuple[Sequence, int]] = []
    finished: list[Sequence] = []
    for (seq, n), token in zip(entries, sampled, strict=True):
        if seq.status is not running:
            continue  # aborted while the pass ran
        computed = seq.num_computed_tokens = seq.num_computed_tokens + n
        if caching and seq.unique_blocks and computed >= (len(seq.full_blocks) + 1) * bs:
            promote(seq)
        if computed < len(seq.tokens):
            continue  # a prefill chunk that has not reached the end
        if token is None:
            raise ValueError(f"no token sampled for {seq.request_id!r}")
        seq.append_token(token)
        tokens_out.append((seq, token))
        n_out = len(seq.tokens) - seq.num_prompt_tokens  # Sequence.finish_after, inlined
        if n_out >= seq.max_tokens:
            reason = length
        elif n_out >= seq.min_tokens and token in seq.stop_token_ids:
            reason = stop
        else:
            continue
        seq.finish_reason, seq.status = reason, finished_status
        finished.append(seq)
    return tokens_out, finished


def plan_running(
    running: list[Sequence],
    i: int,
    budget: int,
    now: float,
    block_size: int,
    scheduled: dict[int, tuple[Sequence, int]],
) -> tuple[int, int, bool]:
    while i < len(running) and budget > 0:
        seq = running[i]
        if seq.pending_transfer:
            if seq.ready_at > now:
                i += 1
                continue
            seq.pending_transfer = False
        num_tokens = len(seq.tokens)
        if seq.num_computed_tokens >= seq.prefill_end and num_tokens > block_size * (
            len(seq.full_blocks) + len(seq.unique_blocks)
        ):  # a decode whose token starts a new block: the caller grows it
            return i, budget, True
        i += 1
        n = num_tokens - seq.num_computed_tokens
        if n > budget:
            n = budget
        scheduled[id(seq)] = (seq, n)
        budget -= n
    return i, budget, False

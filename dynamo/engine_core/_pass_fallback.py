"""Pure-Python twin of ``dynamo.engine_core._pass`` (contract: ``_pass.pyi``), used where the
extension is not built or ``DYN_NATIVE=0``. Import through ``dynamo.engine_core.pass_kernels``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from dynamo.engine_core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from dynamo.engine_core.config import SchedulerLimits
    from dynamo.engine_core.kv_manager import KVManager
    from dynamo.protocol.kv_events import KVCacheEvent

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
        position = seq.num_tokens
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


def schedule_pass(
    running: list[Sequence],
    waiting: deque[Sequence],
    kv: KVManager,
    config: SchedulerLimits,
    now: float,
    transfer_seconds: Callable[[int], float],
) -> tuple[list[tuple[Sequence, int]], list[Sequence], int, int, int]:
    budget = config.max_num_batched_tokens
    bs = config.block_size
    lifo = config.preemption_mode == "lifo"
    scheduled: dict[int, tuple[Sequence, int]] = {}
    preempted: list[Sequence] = []
    i = 0
    while i < len(running) and budget > 0:  # running requests first
        seq = running[i]
        if seq.pending_transfer:
            if seq.ready_at > now:
                i += 1
                continue  # its KV transfer has not landed yet
            seq.pending_transfer = False
        i += 1
        if seq.num_computed_tokens >= seq.prefill_end and seq.num_tokens > bs * (
            len(seq.full_blocks) + len(seq.unique_blocks)
        ):  # a decode whose token starts a new block: grow it, preempting if it must
            while not _grow(kv, seq, bs):
                victim = running[-1] if lifo else running[0]
                if running.index(victim) < i:
                    i -= 1
                entry = scheduled.pop(id(victim), None)
                budget += entry[1] if entry else 0
                _preempt(running, waiting, kv, victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        scheduled[id(seq)] = (seq, n)
        budget -= n
    if not preempted:
        _admit_waiting(running, waiting, kv, config, now, transfer_seconds, budget, scheduled)
    entries = list(scheduled.values())
    prefill_tokens = decodes = context = 0
    for seq, n in entries:
        if seq.num_computed_tokens >= seq.prefill_end:
            decodes += 1
            context += seq.num_tokens
        else:
            prefill_tokens += n
    return entries, preempted, prefill_tokens, decodes, context


def _admit_waiting(
    running: list[Sequence],
    waiting: deque[Sequence],
    kv: KVManager,
    config: SchedulerLimits,
    now: float,
    transfer_seconds: Callable[[int], float],
    budget: int,
    scheduled: dict[int, tuple[Sequence, int]],
) -> None:
    while waiting and budget > 0 and len(running) < config.max_num_seqs:
        seq = waiting[0]
        if not _allocate(kv, config, seq, budget):
            break  # head-of-line: later requests wait behind it (FIFO)
        waiting.popleft()
        running.append(seq)
        if seq.pending_transfer:
            seq.ready_at = now + transfer_seconds(seq.num_prompt_tokens)
            if seq.ready_at > now:
                continue
            seq.pending_transfer = False
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        scheduled[id(seq)] = (seq, n)
        budget -= n


def _allocate(kv: KVManager, config: SchedulerLimits, seq: Sequence, budget: int) -> bool:
    """Admit ``seq``: find its cached prefix and take blocks for all its tokens (FACTS §6.2:
    the whole prompt at the first chunk). False (nothing changed) if it cannot start now."""
    bs, n_tokens = config.block_size, seq.num_tokens
    if seq.pending_transfer:
        computed = n_tokens - 1  # KV arrives from the prefill worker; recompute the last one
    else:
        hit = kv.num_cached_prefix(seq.block_hashes) if seq.reuse_prefix_cache else 0
        computed = min(hit * bs, n_tokens - 1)  # like vLLM, always compute >= 1 token
    new_tokens = n_tokens - computed
    if not config.enable_chunked_prefill and budget < new_tokens <= config.max_num_batched_tokens:
        # Wait for a pass with room. Larger ones (recomputes after a preemption) are chunked
        # anyway: no pass could ever hold them.
        return False
    # Full (shared) at admission: only blocks whose KV is there (cache hits, or the whole
    # transferred prompt); the rest are private until computed, then promoted.
    if not config.enable_prefix_caching:
        n_full = 0
    elif seq.pending_transfer:
        n_full = n_tokens // bs
    else:
        n_full = -(-computed // bs)
    n_unique = -(-n_tokens // bs) - n_full
    full, local = seq.block_hashes[:n_full], seq.local_hashes[:n_full]
    if kv.num_slots_needed(full, n_unique) > kv.num_available_blocks:
        return False
    if full:
        # Blocks received from a prefill worker are not announced: routers only index what
        # this worker computed (the prefill worker owns the prompt's KV, FACTS §9.1).
        kv.use(full, local, announce=not seq.pending_transfer)
    unique = kv.allocate_unique(n_unique)
    assert unique is not None  # room was checked above
    seq.full_blocks, seq.unique_blocks = full, unique
    seq.full_slots = None  # no slots kept: the Python manager's release looks the hashes up
    seq.num_computed_tokens = computed
    seq.prefill_end = computed if seq.pending_transfer else n_tokens
    if seq.num_cached_tokens is None:
        # A received prompt reports the prefill worker's prefix hit as its cached tokens.
        handoff = seq.handoff
        seq.num_cached_tokens = (
            handoff.num_cached_tokens if seq.pending_transfer and handoff else computed
        )
    seq.status = SequenceStatus.RUNNING
    return True


def _grow(kv: KVManager, seq: Sequence, bs: int) -> bool:
    """Make room for the token a decode computes (a new tail block at a block boundary)."""
    missing = -(-seq.num_tokens // bs) - len(seq.full_blocks) - len(seq.unique_blocks)
    if missing <= 0:
        return True
    ids = kv.allocate_unique(missing)
    if ids is None:
        return False
    seq.unique_blocks.extend(ids)
    return True


def _preempt(
    running: list[Sequence], waiting: deque[Sequence], kv: KVManager, seq: Sequence
) -> None:
    """Free the blocks (they stay cached), reset progress, requeue at the front."""
    running.remove(seq)
    release_blocks(kv, seq)
    seq.num_computed_tokens = seq.prefill_end = 0
    seq.num_preemptions += 1
    seq.status = SequenceStatus.WAITING
    waiting.appendleft(seq)


def mock_pass(
    running: list[Sequence],
    waiting: deque[Sequence],
    requests: dict[str, Sequence],
    kv: KVManager,
    config: SchedulerLimits,
    now: float,
    transfer_seconds: Callable[[int], float],
    vocab_size: int,
    excluded: frozenset[int],
) -> tuple[
    list[Sequence],
    int,
    int,
    int,
    list[tuple[Sequence, int]],
    list[Sequence],
    list[KVCacheEvent] | bytes,
]:
    entries, preempted, prefill, decodes, context = schedule_pass(
        running, waiting, kv, config, now, transfer_seconds
    )
    sampled = sample_tokens(entries, vocab_size, excluded)
    tokens, finished = _update(entries, sampled, running, requests, kv, config.block_size)
    events = kv.drain_raw_events() if kv.raw_events else kv.drain_events()
    return preempted, prefill, decodes, context, tokens, finished, events


def release_blocks(kv: KVManager, seq: Sequence) -> None:
    """Release the blocks of ``seq`` and empty its block lists."""
    kv.release(seq.full_blocks, seq.unique_blocks)
    seq.full_blocks, seq.unique_blocks, seq.full_slots = [], [], None


def update_pass(
    entries: list[tuple[Sequence, int]],
    sampled: list[int | None],
    running: list[Sequence],
    requests: dict[str, Sequence],
    kv: KVManager,
    block_size: int,
) -> tuple[list[tuple[Sequence, int]], list[Sequence], list[KVCacheEvent]]:
    tokens_out, finished = _update(entries, sampled, running, requests, kv, block_size)
    return tokens_out, finished, kv.drain_events()


def _update(
    entries: list[tuple[Sequence, int]],
    sampled: list[int | None],
    running: list[Sequence],
    requests: dict[str, Sequence],
    kv: KVManager,
    block_size: int,
) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
    """``update_pass`` but its events (the caller drains them)."""
    if len(entries) != len(sampled):
        raise ValueError("sampled must have one item per batch entry")
    bs = block_size
    caching = kv.enable_prefix_caching
    tokens_out: list[tuple[Sequence, int]] = []
    finished: list[Sequence] = []
    for (seq, n), token in zip(entries, sampled, strict=True):
        if seq.status is not SequenceStatus.RUNNING:
            continue  # aborted while the pass ran
        computed = seq.num_computed_tokens = seq.num_computed_tokens + n
        if caching and seq.unique_blocks and computed >= (len(seq.full_blocks) + 1) * bs:
            _promote_filled(kv, seq, bs)
        if computed < seq.num_tokens:
            continue  # a prefill chunk that has not reached the end
        if token is None:
            raise ValueError(f"no token sampled for {seq.request_id!r}")
        seq.append_token(token)
        tokens_out.append((seq, token))
        reason = seq.finish_after(token)
        if reason is None:
            continue
        seq.finish_reason, seq.status = reason, SequenceStatus.FINISHED
        finished.append(seq)
    if finished:
        for seq in finished:
            release_blocks(kv, seq)
            del requests[seq.request_id]
        running[:] = [s for s in running if s.status is SequenceStatus.RUNNING]
    return tokens_out, finished


def _promote_filled(kv: KVManager, seq: Sequence, bs: int) -> None:
    """Private tail blocks whose KV is complete become shareable full blocks."""
    k = len(seq.full_blocks)
    n = min(seq.num_computed_tokens // bs - k, len(seq.unique_blocks))
    if n <= 0:
        return
    hashes = seq.block_hashes[k : k + n]
    parent = seq.block_hashes[k - 1] if k else None
    kv.promote_run(seq.unique_blocks[:n], hashes, seq.local_hashes[k : k + n], parent)
    del seq.unique_blocks[:n]
    seq.full_blocks.extend(hashes)
    seq.full_slots = None

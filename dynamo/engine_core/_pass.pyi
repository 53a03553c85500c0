"""Type stub of the native module ``dynamo.engine_core._pass`` (source: ``_pass.c``; the same
contract in Python: ``_pass_fallback.py``). Import through ``dynamo.engine_core.pass_kernels``.

Both implementations mutate the same state: the scheduler's ``Sequence`` objects (fields as
``sequence.py`` documents them), its running list and waiting deque, its request table and its
``KVManager`` (through the manager's public methods, so either KV implementation works)."""

from collections import deque
from collections.abc import Callable

from dynamo.engine_core.config import SchedulerLimits
from dynamo.engine_core.kv_manager import KVManager
from dynamo.engine_core.sequence import Sequence
from dynamo.protocol.kv_events import KVCacheEvent

def sample_tokens(
    entries: list[tuple[Sequence, int]], vocab_size: int, excluded: frozenset[int]
) -> list[int | None]:
    """The mocker's next id for each batch entry ``(seq, n)`` that samples in this pass (it
    reaches the end of its known tokens), None for the others. The id is a function of
    ``seq.rng_state`` and the position only: SplitMix64's finaliser, then an LCG walk past ids
    in ``excluded`` or ``seq.banned_token_ids`` (rejection sampling)."""

def schedule_pass(
    running: list[Sequence],
    waiting: deque[Sequence],
    kv: KVManager,
    config: SchedulerLimits,
    now: float,
    transfer_seconds: Callable[[int], float],
) -> tuple[list[tuple[Sequence, int]], list[Sequence], int, int, int]:
    """Plan the pass starting at ``now`` (vLLM v1, FACTS §6.2) and apply its allocations.

    ``running`` in order while the token budget (``config.max_num_batched_tokens``) lasts: a
    sequence whose KV transfer lands after ``now`` is skipped (one whose transfer landed is
    cleared of ``pending_transfer``); a decode whose token starts a new block takes one, and
    when none is free the victim (``preemption_mode``: the last running, or the first) is
    preempted (blocks released, progress reset, ``num_preemptions`` + 1, status waiting, moved
    to the front of ``waiting``; its entry and budget are given back) until it fits or is the
    victim itself. Without a preemption, ``waiting`` is admitted in FIFO order while budget and
    ``max_num_seqs`` allow: its cached prefix found (unless ``reuse_prefix_cache`` is off; a
    decode-side ``pending_transfer`` sequence has all but its last token's KV), blocks taken
    for all its tokens (full at admission: the hits, or the whole received prompt, referenced
    with ``use``, announced unless received; the rest private), ``num_computed_tokens``,
    ``prefill_end``, ``num_cached_tokens`` (first admission only) and status set; it stops at
    the first that does not fit (head of line). A received sequence waits
    ``transfer_seconds(num_prompt_tokens)`` (``ready_at``) before it runs.

    Each scheduled sequence gets its uncomputed tokens, capped by the budget left. Returns
    ``(entries, preempted, num_prefill_tokens, num_decodes, decode_context_tokens)``: the
    ``(sequence, tokens)`` entries in batch order, the preempted in order, and the batch's
    figures (an entry past its ``prefill_end`` is a decode counting its ``len(tokens)`` as
    context; the others count their tokens as prefill)."""

def update_pass(
    entries: list[tuple[Sequence, int]],
    sampled: list[int | None],
    running: list[Sequence],
    requests: dict[str, Sequence],
    kv: KVManager,
    block_size: int,
) -> tuple[list[tuple[Sequence, int]], list[Sequence], list[KVCacheEvent]]:
    """Apply a pass the engine ran, entry by entry in batch order: skip a sequence no longer
    running (aborted while the pass ran); add ``n`` to ``num_computed_tokens``; with prefix
    caching on, promote the private blocks whose KV is now complete (``kv.promote_run``);
    when the sequence reached its end, append ``sampled[i]`` (a completed block is hashed as
    ``router.hashing`` does: XXH3-64, chained) and apply its stop rules (``max_tokens``:
    length; a stop id past ``min_tokens``: stop) to set ``finish_reason`` and status finished.
    Then the finished release their blocks, leave ``requests`` and ``running`` (in place).
    Returns ``(tokens, finished, events)``: the appended ``(seq, token)`` pairs, the finished
    sequences (batch order), and the KV events the pass produced (``kv.drain_events()``).
    ``ValueError`` if an entry that reached its end has no token, or the lengths differ."""

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
    """One whole mocker pass in one call: ``schedule_pass``, ``sample_tokens`` over its
    entries, ``update_pass`` with those ids. Returns ``(preempted, num_prefill_tokens,
    num_decodes, decode_context_tokens, tokens, finished, events)``: what the caller acts on
    (its timing model takes the three figures). ``events``: ``kv.drain_raw_events()`` when
    ``kv.raw_events`` (one ``bytes``, ``dynamo.protocol.kv_raw``), else ``kv.drain_events()``."""

def release_blocks(kv: KVManager, seq: Sequence) -> None:
    """Release ``seq``'s blocks (``kv.release``) and empty its ``full_blocks`` and
    ``unique_blocks``."""

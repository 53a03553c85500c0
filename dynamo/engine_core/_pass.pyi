"""Type stub of the native module ``dynamo.engine_core._pass`` (source: ``_pass.c``; the same
contract in Python: ``_pass_fallback.py``). Import through ``dynamo.engine_core.pass_kernels``."""

from collections.abc import Callable
from typing import Any

from dynamo.engine_core.sequence import Sequence

def sample_tokens(
    entries: list[tuple[Sequence, int]], vocab_size: int, excluded: frozenset[int]
) -> list[int | None]:
    """The mocker's next id for each batch entry ``(seq, n)`` that samples in this pass (it
    reaches the end of its known tokens), None for the others. The id is a function of
    ``seq.rng_state`` and the position only: SplitMix64's finaliser, then an LCG walk past ids
    in ``excluded`` or ``seq.banned_token_ids`` (rejection sampling)."""

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
    """Apply a pass to its entries, in order: skip a sequence whose ``status`` is not
    ``running``; add ``n`` to ``num_computed_tokens``; with ``caching``, call ``promote(seq)``
    when a private block's KV is now complete; when the sequence reached its end, append
    ``sampled[i]`` (``Sequence.append_token``: a completed block is hashed with ``hash_fn``,
    XXH3-64) and, if a stop rule fires (``max_tokens`` reached: ``length``; a stop id past
    ``min_tokens``: ``stop``), set ``finish_reason`` and ``status = finished_status``.
    Returns the appended ``(seq, token)`` pairs and the finished sequences, in batch order.
    ``ValueError`` if an entry that reached its end has no token."""

def plan_running(
    running: list[Sequence],
    i: int,
    budget: int,
    now: float,
    block_size: int,
    scheduled: dict[int, tuple[Sequence, int]],
) -> tuple[int, int, bool]:
    """Schedule ``running[i:]`` in order while ``budget`` tokens remain: a sequence whose KV
    transfer lands after ``now`` is skipped (one whose transfer landed is cleared of
    ``pending_transfer``); each other one gets ``scheduled[id(seq)] = (seq, n)`` with ``n`` its
    uncomputed tokens, capped by the budget, which ``n`` reduces. Stops before a decode whose
    token starts a new block (it needs a block the caller allocates, preempting if it must).
    Returns ``(i, budget, grow)``: the next index, the budget left, and whether it stopped for
    such a decode (``running[i]``)."""

"""Type stub of the native module ``dynamo.router._active`` (source: ``_active.c``; the same
contract in Python: ``_active_fallback.py``). Import through ``dynamo.router.sequences``.

Each function is the ``ActiveSequences`` method of its name on ``seqs`` (an
``ActiveSequences``; ``rank`` one of its ranks), with the same effects, results and errors."""

from collections.abc import Sequence
from typing import Any

def add_routed(
    seqs: Any,
    request_id: str,
    rank: Any,
    sequence_hashes: Sequence[int],
    new_isl_tokens: int,
    overlap_blocks: int,
    prefix_keys: bytes | None,
) -> bool: ...
def mark_prefill_completed(seqs: Any, request_id: str) -> bool: ...
def free(seqs: Any, request_id: str) -> bool: ...

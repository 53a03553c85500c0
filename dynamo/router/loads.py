"""The load records ``ActiveSequences``' queries return (one per worker rank): plain values,
kept apart from the accounting that computes them."""

from __future__ import annotations

import msgspec


class PotentialLoad(msgspec.Struct, gc=False):
    """What one worker rank's load would be if a new request were added there.

    ``potential_prefill_tokens`` = active prefill tokens + the new request's tokens;
    ``potential_decode_blocks`` = active unique blocks + the request's blocks not already active;
    ``active_requests`` = requests active there now (not counting the new one).
    """

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


class ActiveLoad(msgspec.Struct, gc=False):
    """One worker rank's current load."""

    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int
    active_requests: int


class LoadProjection(msgspec.Struct, gc=False):
    """One worker rank's load and what a new request would add there (the router's view).

    ``new_decode_blocks``: the request's blocks not already active on the rank, so
    potential decode blocks = ``active_decode_blocks + new_decode_blocks``.
    """

    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int
    new_decode_blocks: int
    active_requests: int

"""Type stub of the native module ``dynamo.router._route`` (source: ``_route.c``; the same
contract in Python: ``_route_fallback.py``). Import through ``dynamo.router.core``."""

import random
from collections.abc import Sequence
from typing import Any

def choose(
    matches: dict[Any, int],
    key_of: list[tuple[int, int]] | None,
    place_of: dict[tuple[int, int], int],
    ranks: Sequence[object],
    new: list[int],
    isl_tokens: int,
    block_size: int,
    params: tuple[float, float, float, float, bool],
    rng: random.Random,
    track_blocks: bool,
) -> tuple[int, int, list[float]]:
    """The KV router's choice among its targets (FACTS §4.2-§4.3): ``(place, overlap blocks,
    costs)``, ``place`` indexing ``ranks`` and ``costs`` one per target, in order.

    ``ranks``: each target's load holder (an object with int ``prefill_tokens``,
    ``private_blocks``, ``num_requests`` and a sized ``blocks``: ``ActiveSequences``' ranks);
    its decode blocks are ``len(blocks) + private_blocks``. ``new``: the request's blocks new on
    each target. ``track_blocks`` false: decode and new blocks count 0. ``matches``: matched
    prefix blocks per target, keyed by a slot of ``key_of`` (a list: slot -> (worker_id,
    dp_rank)) or, ``key_of`` None, by the (worker_id, dp_rank) itself; ``place_of`` maps a key
    to its place in ``ranks`` (a key it lacks is not a target: ignored). The costs are
    ``_cost.costs`` of those columns (``params`` as there), the choice
    ``_cost.argmin_random_tie`` of them, with the same draws from ``rng``. ValueError for no
    ranks, ``new`` of another length or ``block_size <= 0``; IndexError for a slot outside
    ``key_of`` or a place outside ``ranks``."""

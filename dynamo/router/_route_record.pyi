"""Type stub of the native module ``dynamo.router._route_record`` (source: ``_route_record.c``;
the same contract in Python: ``_route_record_fallback.py``). Import through
``dynamo.router.core``."""

import random
from collections.abc import Callable, Sequence
from typing import Any

class RouteRecorder:
    """The KV router's common request routed and recorded in one call (``RoutingCore.route``:
    every target eligible, temperature 0, no busy thresholds, the exact index, prefix keys).

    Held, not copied: ``find_matches`` (the index tree's: slot -> matched blocks), ``key_of``
    (slot -> key, live), ``place_of`` (key -> place), ``keys`` / ``ranks`` / ``tables`` (each
    target's key, ``ActiveSequences`` rank and its block table, in order; at least one),
    ``resolved`` (``sequences.resolved`` when ``ranks`` were resolved: the recorder serves while
    it is still that object), ``sequences`` and ``add_routed`` (the function
    ``sequences.add_routed``: it records), ``new_blocks_of_keys`` (``block_counts``'),
    ``choose`` (``_route.choose``), ``selection`` (``Selection``), and the kernel's
    ``params``, ``rng``, ``track_blocks`` and ``block_size`` (> 0)."""

    def __init__(
        self,
        find_matches: Callable[[Sequence[int]], dict[int, int]],
        key_of: list[tuple[int, int]],
        place_of: dict[tuple[int, int], int],
        keys: list[tuple[int, int]],
        ranks: list[Any],
        tables: list[Any],
        resolved: object,
        sequences: Any,
        add_routed: Callable[..., bool],
        new_blocks_of_keys: Callable[[list[Any], bytes], list[int]],
        choose: Callable[..., tuple[int, int, list[float]]],
        selection: Callable[..., Any],
        params: tuple[float, float, float, float, bool],
        rng: random.Random,
        track_blocks: bool,
        block_size: int,
    ) -> None: ...
    def route(
        self,
        request_id: str,
        local_hashes: Sequence[int],
        seq_hashes: Sequence[int],
        isl_tokens: int,
        prefix_keys: bytes,
        record: bool,
    ) -> Any:
        """``RoutingCore._choose`` of the request: ``choose`` over the matches of
        ``local_hashes`` (none if it is empty) and the new blocks of ``prefix_keys`` on each
        table, the ``selection(worker_id, dp_rank, cost, overlap, cached_tokens, keys, costs)``
        of its choice, and (``record``) ``add_routed(sequences, request_id, rank, seq_hashes,
        isl_tokens, overlap, prefix_keys)`` on the chosen rank. None, with nothing done or
        drawn, when ``sequences.resolved`` is no longer ``resolved`` or ``isl_tokens`` is not
        an exact int within ±2**40 (the caller routes in Python). The callees' errors
        propagate."""

"""Pure-Python twin of ``dynamo.router._route_record`` (contract: ``_route_record.pyi``): the
KV router's common request routed and recorded in one call. Import through
``dynamo.router.core``."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

_LIMIT = 1 << 40  # a token count past this takes the caller's Python route


class RouteRecorder:
    """See ``_route_record.pyi``."""

    __slots__ = (
        "_find",
        "_key_of",
        "_place_of",
        "_keys",
        "_ranks",
        "_tables",
        "_resolved",
        "_sequences",
        "_add",
        "_new_blocks",
        "_choose",
        "_selection",
        "_params",
        "_rng",
        "_track",
        "_bs",
    )

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
    ) -> None:
        for value, kind in ((key_of, list), (place_of, dict), (keys, list), (ranks, list)):
            if not isinstance(value, kind):
                raise TypeError(f"expected a {kind.__name__}, not {type(value).__name__}")
        if not isinstance(tables, list) or not isinstance(params, tuple):
            raise TypeError("tables is a list and params a tuple")
        if len(keys) != len(ranks) or len(ranks) != len(tables) or not ranks:
            raise ValueError("keys, ranks and tables: one each per target, at least one")
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self._find, self._key_of, self._place_of = find_matches, key_of, place_of
        self._keys, self._ranks, self._tables = keys, ranks, tables
        self._resolved, self._sequences = resolved, sequences
        self._add = add_routed
        self._new_blocks, self._choose, self._selection = new_blocks_of_keys, choose, selection
        self._params, self._rng, self._track = params, rng, bool(track_blocks)
        self._bs = block_size

    def route(
        self,
        request_id: str,
        local_hashes: Sequence[int],
        seq_hashes: Sequence[int],
        isl_tokens: int,
        prefix_keys: bytes,
        record: bool,
    ) -> Any:
        if self._sequences.resolved is not self._resolved:
            return None  # the ranks changed since: the caller routes and builds a new one
        if type(isl_tokens) is not int or not -_LIMIT < isl_tokens < _LIMIT:
            return None  # an unusual token count: the caller's Python route
        matches = self._find(local_hashes) if local_hashes else {}
        new = self._new_blocks(self._tables, prefix_keys)
        bs = self._bs
        i, overlap, costs = self._choose(
            matches,
            self._key_of,
            self._place_of,
            self._ranks,
            new,
            isl_tokens,
            bs,
            self._params,
            self._rng,
            self._track,
        )
        keys = self._keys
        worker_id, dp_rank = keys[i]
        cached = min(overlap * bs, max(isl_tokens, 0))
        chosen = self._selection(worker_id, dp_rank, costs[i], overlap, cached, keys, costs)
        if record:
            add = self._add
            add(
                self._sequences,
                request_id,
                self._ranks[i],
                seq_hashes,
                isl_tokens,
                overlap,
                prefix_keys,
            )
        return chosen

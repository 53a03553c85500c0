"""Pure-Python twin of ``dynamo.router._apply_raw`` (contract: ``_apply_raw.pyi``): a KV
indexer's common raw events buffer (known rank, not recovering, the next id) decided, applied
and counted in one call."""

from __future__ import annotations

import struct
from typing import Any

_HEADER = struct.Struct("=3Q")  # dp_rank, first_event_id, count (dynamo.protocol.kv_raw)
_U64_MAX = (1 << 64) - 1


class InOrderApplier:
    """See ``_apply_raw.pyi``."""

    __slots__ = ("_ranks", "_tree", "_counters", "_keys")

    def __init__(
        self,
        ranks: dict[tuple[int, int], Any],
        tree: Any,
        counters: dict[Any, int],
        ok: object,
        parent: object,
        block: object,
    ) -> None:
        if type(ranks) is not dict or type(counters) is not dict:
            raise TypeError("ranks and counters are dicts")
        self._ranks, self._tree, self._counters = ranks, tree, counters
        self._keys = (ok, parent, block)

    def apply(self, worker_id: int, raw: bytes) -> bool:
        if not isinstance(raw, bytes):
            raise TypeError("raw events are bytes")
        if not raw:
            return True
        if len(raw) < _HEADER.size:
            return False
        dp_rank, first, n = _HEADER.unpack_from(raw)
        if n == 0 or first + n - 1 > _U64_MAX:
            return False
        st = self._ranks.get((worker_id, dp_rank))
        if st is None or st.recovering:
            return False
        last = st.last_id
        if not isinstance(last, int) or not 0 <= last < _U64_MAX or first != last + 1:
            return False
        counts = self._tree.apply_raw(st.slot, raw)
        st.last_id = first + n - 1
        counters = self._counters
        for key, c in zip(self._keys, counts, strict=True):
            if c:
                counters[key] += c
        return True

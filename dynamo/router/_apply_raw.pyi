"""Type stub of the native module ``dynamo.router._apply_raw`` (source: ``_apply_raw.c``; the
same contract in Python: ``_apply_raw_fallback.py``). Import through ``dynamo.router.indexer``."""

from typing import Any

class InOrderApplier:
    """A KV indexer's common raw events buffer in one call (``KVIndexer.apply_raw``).

    ``ranks``: the indexer's (worker_id, dp_rank) -> rank state (an object with ``slot``,
    ``last_id`` (an int or None) and ``recovering``); ``tree``: its tree (``apply_raw(slot, raw)
    -> (ok, parent, block)``); ``counters``: its status -> events dict, and the statuses ``ok``,
    ``parent`` and ``block`` that the tree's three counts add to. All held, not copied."""

    def __init__(
        self,
        ranks: dict[tuple[int, int], Any],
        tree: Any,
        counters: dict[Any, int],
        ok: object,
        parent: object,
        block: object,
    ) -> None: ...
    def apply(self, worker_id: int, raw: bytes) -> bool:
        """Apply ``raw`` (``dynamo.protocol.kv_raw``) of ``worker_id`` if it is the common case:
        the rank is known and not recovering and the buffer's first id is its last id + 1 (and
        the new last id a uint64). Then the tree applies it, the rank's ``last_id`` becomes its
        last event's id, the counters add the tree's counts, and True is returned; also True for
        ``b""`` (no event). False, with nothing changed, for anything else (the caller decodes
        it). TypeError for a ``raw`` that is not bytes; the tree's errors (a malformed buffer)
        propagate before anything changes."""

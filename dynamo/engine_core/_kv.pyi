"""Type stub of the native module ``dynamo.engine_core._kv`` (source: ``_kv.c``; the same
contract in Python: ``_kv_fallback.py``). Import through ``dynamo.engine_core.kv_kernels``.

The containers are ``KVManager``'s own: ``active`` (full block -> refcount), ``inactive`` (the
LRU pool, least recently used first), ``slots`` / ``locals_`` (full block -> its slot / local
hash), ``silent`` (cached blocks never announced), ``free_slots`` (popped from the end)."""

from collections import OrderedDict
from collections.abc import Sequence

def cached_prefix(
    active: dict[int, int], inactive: OrderedDict[int, None], hashes: Sequence[int]
) -> int:
    """Length of the longest run of leading ``hashes`` present in ``active`` or ``inactive``."""

def count_missing(active: dict[int, int], hashes: Sequence[int]) -> int:
    """How many of ``hashes`` are not in ``active``."""

def pin(
    active: dict[int, int], inactive: OrderedDict[int, None], hashes: Sequence[int]
) -> list[int]:
    """One reference more to each of ``hashes`` in ``active``; one in ``inactive`` leaves the
    pool for ``active`` with one reference. Returns the indices of the others (in neither), in
    order (a repeated absent hash, at each of its indices)."""

def release_full(
    active: dict[int, int], inactive: OrderedDict[int, None], hashes: Sequence[int]
) -> None:
    """One reference less to each of ``hashes``, last first; a block whose count reaches 0
    leaves ``active`` for the most recent end of ``inactive``. KeyError for a block that is
    not active (the blocks before it, in release order, are released)."""

def evict(
    inactive: OrderedDict[int, None],
    slots: dict[int, int],
    locals_: dict[int, int],
    silent: set[int],
    free_slots: list[int],
    n: int,
) -> list[int]:
    """Pop the ``n`` least recently used inactive blocks: each frees its slot (appended to
    ``free_slots``) and leaves ``slots``, ``locals_`` and ``silent``. Returns the evicted
    blocks that were announced (not ``silent``), in eviction order."""

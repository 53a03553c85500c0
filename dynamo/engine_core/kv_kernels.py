"""The per-block loops of ``KVManager``'s accounting: the native module (``_kv.c``) or its
pure-Python fallback (``_kv_fallback.py``), chosen once by ``dynamo.native`` (``DYN_NATIVE``).
The contract of both is ``_kv.pyi``; import from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load("dynamo.engine_core._kv", "dynamo.engine_core._kv_fallback")
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.engine_core._kv`` or ``dynamo.engine_core._kv_fallback``)."""

if TYPE_CHECKING:
    from dynamo.engine_core._kv import cached_prefix, count_missing, evict, pin, release_full
else:
    cached_prefix, count_missing = _impl.cached_prefix, _impl.count_missing
    evict, pin, release_full = _impl.evict, _impl.pin, _impl.release_full

__all__ = ["IMPLEMENTATION", "cached_prefix", "count_missing", "evict", "pin", "release_full"]

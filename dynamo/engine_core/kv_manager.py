"""KV block mechanism of one DP rank (FACTS §6.3): refcounted active blocks, an LRU inactive pool,
prefix lookup by sequence hash, the physical slot each block occupies, and the KV events
(Stored / Removed) those changes produce.

It decides nothing: the scheduler checks ``num_slots_needed`` first, then orders the change. The
mocker uses only the accounting; a real engine also reads the slots (its block tables index the
KV pool tensors with them).

The native table (``_kv.c``) or its pure-Python twin (``_kv_fallback.py``), chosen once by
``dynamo.native`` (``DYN_NATIVE``); the contract of both is ``_kv.pyi``. Import ``KVManager``
from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load(
    "dynamo.engine_core._kv", "dynamo.engine_core._kv_fallback", requires=("KVManager",)
)
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.engine_core._kv`` or ``dynamo.engine_core._kv_fallback``)."""

if TYPE_CHECKING:
    from dynamo.engine_core._kv import KVManager
else:
    KVManager = _impl.KVManager

__all__ = ["IMPLEMENTATION", "KVManager"]

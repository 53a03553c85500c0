"""``BlockCounts``, ``prefix_keys`` and the trie walks: the native table (``_blocks.c``) or its
pure-Python fallback (``_blocks_fallback.py``), chosen once by ``dynamo.native`` (``DYN_NATIVE``).

The contract of both is ``_blocks.pyi``; import these names from here, never from either
implementation, so that one process never mixes the two (their seeded keys differ).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load(
    "dynamo.router._blocks", "dynamo.router._blocks_fallback", requires=("new_blocks_of_keys",)
)
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.router._blocks`` or ``dynamo.router._blocks_fallback``)."""

if TYPE_CHECKING:
    from dynamo.router._blocks import (
        BlockCounts,
        new_blocks,
        new_blocks_of_keys,
        prefix_key_bytes,
        prefix_keys,
    )
else:
    BlockCounts = _impl.BlockCounts
    new_blocks = _impl.new_blocks
    new_blocks_of_keys = _impl.new_blocks_of_keys
    prefix_key_bytes = _impl.prefix_key_bytes
    prefix_keys = _impl.prefix_keys

__all__ = [
    "IMPLEMENTATION",
    "BlockCounts",
    "new_blocks",
    "new_blocks_of_keys",
    "prefix_key_bytes",
    "prefix_keys",
]

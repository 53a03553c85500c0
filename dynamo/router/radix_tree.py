"""The prefix tree of KV blocks held by workers (FACTS §3.1): the mechanism under the router's
indexer, the worker-local index and the approximate index. Pure data: no event ids, no I/O.

The native table (``_radix.c``) or its pure-Python twin (``_radix_fallback.py``, path-compressed
runs), chosen once by ``dynamo.native`` (``DYN_NATIVE``); the contract of both is ``_radix.pyi``.
Import ``RadixTree`` from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load(
    "dynamo.router._radix", "dynamo.router._radix_fallback", requires=("RadixTree",)
)
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.router._radix`` or ``dynamo.router._radix_fallback``)."""

if TYPE_CHECKING:
    from dynamo.router._radix import RadixTree
else:
    RadixTree = _impl.RadixTree

__all__ = ["IMPLEMENTATION", "RadixTree"]

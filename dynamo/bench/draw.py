"""Uniform random draws of the workloads' words: the native module (``_draw.c``) or its
pure-Python twin (``_draw_fallback.py``, ``random.choices``), chosen once by ``dynamo.native``
(``DYN_NATIVE``); the contract of both is ``_draw.pyi``. Import ``choices``, ``extended``
and ``packed`` from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load(
    "dynamo.bench._draw", "dynamo.bench._draw_fallback", requires=("choices", "extended", "packed")
)
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.bench._draw`` or ``dynamo.bench._draw_fallback``)."""

if TYPE_CHECKING:
    from dynamo.bench._draw import choices, extended, packed
else:
    choices, extended, packed = _impl.choices, _impl.extended, _impl.packed

__all__ = ["IMPLEMENTATION", "choices", "extended", "packed"]

"""``plan_running``, ``sample_tokens`` and ``advance``, the per-entry loops of a scheduler
pass: the native module (``_pass.c``) or its pure-Python fallback (``_pass_fallback.py``),
chosen once by ``dynamo.native`` (``DYN_NATIVE``). The contract of both is ``_pass.pyi``;
import from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load("dynamo.engine_core._pass", "dynamo.engine_core._pass_fallback")
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.engine_core._pass`` or ``dynamo.engine_core._pass_fallback``)."""

if TYPE_CHECKING:
    from dynamo.engine_core._pass import advance, plan_running, sample_tokens
else:
    advance, plan_running, sample_tokens = _impl.advance, _impl.plan_running, _impl.sample_tokens

__all__ = ["IMPLEMENTATION", "advance", "plan_running", "sample_tokens"]

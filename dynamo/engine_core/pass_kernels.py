"""``schedule_pass`` and ``update_pass`` (one scheduler pass of one DP rank, each one call),
``release_blocks``, the mocker's ``sample_tokens`` and ``mock_pass`` (a whole mocker pass):
the native module (``_pass.c``) or its pure-Python fallback (``_pass_fallback.py``), chosen
once by ``dynamo.native`` (``DYN_NATIVE``). The contract of both is ``_pass.pyi``; import from
here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load(
    "dynamo.engine_core._pass",
    "dynamo.engine_core._pass_fallback",
    requires=("schedule_pass", "update_pass", "release_blocks", "mock_pass"),
)
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.engine_core._pass`` or ``dynamo.engine_core._pass_fallback``)."""

if TYPE_CHECKING:
    from dynamo.engine_core._pass import (
        mock_pass,
        release_blocks,
        sample_tokens,
        schedule_pass,
        update_pass,
    )
else:
    release_blocks, sample_tokens = _impl.release_blocks, _impl.sample_tokens
    schedule_pass, update_pass = _impl.schedule_pass, _impl.update_pass
    mock_pass = _impl.mock_pass

__all__ = [
    "IMPLEMENTATION",
    "mock_pass",
    "release_blocks",
    "sample_tokens",
    "schedule_pass",
    "update_pass",
]

"""A replay pass's tokens into its requests' records: the native loop (``_deliver.c``) or its
Python twin (``_deliver_fallback.py``), chosen once by ``dynamo.native`` (``DYN_NATIVE``); the
contract of both is ``_deliver.pyi``. Import ``deliver`` from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load(
    "dynamo.replay._deliver", "dynamo.replay._deliver_fallback", requires=("deliver",)
)
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.replay._deliver`` or ``dynamo.replay._deliver_fallback``)."""

if TYPE_CHECKING:
    from dynamo.replay._deliver import deliver
else:
    deliver = _impl.deliver

__all__ = ["IMPLEMENTATION", "deliver"]

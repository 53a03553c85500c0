"""``Sender``, the write-behind thread: the native one (``_sender.c``) or its pure-Python
fallback (``_sender_fallback.py``), chosen once by ``dynamo.native`` (``DYN_NATIVE``).

Imported only by servers that turn write-behind on (``HttpServer(write_behind=True)``). The
contract of both is ``_sender.pyi``; the fallback keeps it but writes under the GIL, so it
brings none of the native thread's speed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo import native

_impl = native.load("dynamo.runtime._sender", "dynamo.runtime._sender_fallback")
IMPLEMENTATION: str = _impl.__name__

if TYPE_CHECKING:
    from dynamo.runtime._sender import Sender
else:
    Sender = _impl.Sender

__all__ = ["IMPLEMENTATION", "Sender"]

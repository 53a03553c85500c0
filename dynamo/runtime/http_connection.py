"""What the small HTTP server (``http_server.py``) shares with the connections it accepts: the
states its timeout sweep reads, the :class:`Connection` contract, and the :class:`ServerContext`
a connection factory receives (``HttpServer(connection=...)``: the frontend's connections,
``frontend/http_front.py``; the JSON servers' own is ``http_json.HttpProtocol``)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dynamo.runtime.http_limits import HttpLimits
from dynamo.runtime.write_behind import WriteBehind

log = logging.getLogger(__name__)

# A connection's state, for the timeout sweep: between requests, in the headers, in the body,
# new (no byte yet: the header timeout), busy (a handler owns it: its own deadlines apply).
IDLE, HEAD, BODY, NEW, BUSY = 0, 1, 2, 3, 4


class Connection(Protocol):
    """What the server's sweep and stop need of a connection (``HttpProtocol`` or another
    protocol made by ``HttpServer(connection=...)``): ``state`` (``IDLE`` ... ``BUSY``) and
    ``since`` (when it entered it), ``expire()`` once the state outlived its timeout,
    ``close()`` and ``release_fd()`` at stop."""

    state: int
    since: float

    def expire(self) -> None: ...

    def close(self) -> None: ...

    def release_fd(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ServerContext:
    """What a server shares with each of its connections."""

    connections: set[Any]
    """The open connections: a connection adds itself once accepted, discards itself on loss."""
    write_behind: WriteBehind | None
    accepting: Callable[[], bool]
    limits: HttpLimits


ConnectionFactory = Callable[[ServerContext], asyncio.Protocol]
"""Makes the protocol of one accepted connection (it must also be a :class:`Connection`)."""


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LINGER_S = 2.0
"""After an answer that leaves request bytes unread (413, an unread body, a framing error), a
connection reads and drops its input this long before it closes, so the client reads the
answer, not a reset."""


class ParseAbort(Exception):
    """Raised from a parser callback to stop parsing a connection's input."""


def write_behind_fd(transport: asyncio.BaseTransport, write_behind: WriteBehind | None) -> int:
    """A dup of ``transport``'s socket for the write-behind thread, or -1: no thread (or it is
    stopping), or no descriptor left (the connection then writes through its transport)."""
    if write_behind is None or not write_behind.running:
        return -1
    try:
        return os.dup(transport.get_extra_info("socket").fileno())
    except OSError as exc:
        log.warning("write-behind unavailable for a connection: %s", exc)
        return -1

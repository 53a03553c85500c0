"""The HTTP seam: one request/response as the handlers see it.

``http_exchange.py`` implements :class:`Exchange` for the frontend's HTTP connections;
``tests/fakes.py`` has an in-memory ``FakeExchange``, so every handler is unit-tested without a
socket. Nothing here imports the
handlers, which keeps the frontend's modules free of import cycles.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol


class ClientDisconnected(ConnectionError):
    """The client went away (closed or half-closed its connection) before the exchange ended:
    a cancellation, never a server error."""


class StreamSink(Protocol):
    async def send(self, data: bytes) -> None:
        """Write to the client; raises (ConnectionError or the server's error) once it is gone."""
        ...


class Exchange(Protocol):
    """One HTTP request/response. A handler answers exactly once: :meth:`reply` (a whole body)
    or :meth:`start_stream` (a status line now, the body through the sink)."""

    method: str
    path: str

    def header(self, name: str) -> str | None: ...

    async def body(self, limit: int) -> bytes:
        """The request body; HTTPError 413 beyond ``limit`` bytes, HTTPError 408 when the client
        does not send it in time, ClientDisconnected when it goes away before its end."""
        ...

    def reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None: ...

    def start_stream(self, status: int, headers: list[tuple[str, str]]) -> StreamSink: ...

    def disconnected(self) -> Awaitable[None]:
        """Resolves when the client goes away."""
        ...

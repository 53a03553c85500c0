"""The request-plane contract.

One **server** per process serves every endpoint of that process. A handler receives the encoded
request body and the request's :class:`Context`, and yields encoded response bodies. The plane
wraps each body in an ``Annotated`` data frame, ends every successful stream with
``complete_final``, and turns a :class:`DynamoError` raised by the handler into a typed error
frame (any other exception becomes ``Unknown``).

A **client** opens a stream to an instance's address. Iterating it yields response bodies; an error
frame is raised as the same ``DynamoError`` subclass; a stream that ends without
``complete_final`` raises ``StreamIncomplete`` (or ``Disconnected`` if the connection broke).
When the caller's context stops (or is killed) the client sends a cancel frame and the server stops
(kills) the handler's context. Breaking out of the iteration (``aclose``) also cancels.

Backpressure: a server never buffers more than a bounded number of frames per stream for a slow
client; the handler's ``yield`` blocks instead.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Protocol

from dynamo.runtime.context import Context

Handler = Callable[[bytes, Context], AsyncIterator[bytes]]
"""``handler(request_body, ctx)`` -> async iterator of response bodies."""


class RequestPlaneServer(Protocol):
    @property
    def address(self) -> str:
        """Where clients reach this server (e.g. ``tcp://127.0.0.1:40123`` or ``local://<id>``)."""
        ...

    async def start(self) -> None: ...

    def register(self, endpoint_path: str, handler: Handler) -> None:
        """Serve ``endpoint_path`` with ``handler``. Re-registering replaces. The runtime routes
        per instance (``EndpointId.instance_path``: ``ns.comp.ep/<instance id hex>``)."""
        ...

    def unregister(self, endpoint_path: str) -> None:
        """Stop accepting new requests for the endpoint; in-flight streams continue."""
        ...

    def num_inflight(self) -> int:
        """Streams currently being served (all endpoints)."""
        ...

    async def stop(self) -> None:
        """Close listeners and connections; cancel in-flight handlers (idempotent)."""
        ...


class RequestPlaneClient(Protocol):
    def stream(
        self, address: str, endpoint_path: str, body: bytes, ctx: Context
    ) -> AsyncGenerator[bytes, None]:
        """Send one request; iterate its response bodies (see module docstring). ``aclose()``
        before the end cancels the request on the server."""
        ...

    def stream_batches(
        self, address: str, endpoint_path: str, body: bytes, ctx: Context
    ) -> AsyncGenerator[list[bytes], None]:
        """Like :meth:`stream`, yielding every response body already received as one list
        (for consumers that coalesce when they fall behind)."""
        ...

    async def close(self) -> None: ...

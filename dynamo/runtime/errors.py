"""The one error tree of dynamo-py.

::

    DynamoError
    ├── InvalidArgument        engine or setup rejected the input           (HTTP 400)
    ├── ModelNotFound          no such model                                (HTTP 404)
    ├── NoInstances            a model/endpoint has no live instance        (HTTP 503)
    ├── Overloaded             every eligible worker is busy / queue full   (HTTP 529, Retry-After)
    ├── CannotConnect          can't reach discovery, a dependency or an instance
    ├── EngineShutdown         engine failed to start / crashed / is stopping
    ├── WorkerShutdown         the worker is shutting down
    ├── StreamIncomplete       a stream ended before its complete_final
    ├── Cancelled              the request was cancelled
    ├── ResponseTimeout        no response in time
    ├── Disconnected           the transport connection was lost mid-stream
    ├── ConnectionTimeout      connecting timed out
    ├── KVTransferFailed       a decode worker could not fetch its prompt's KV from the
    │                          prefill worker (that worker failed, not the one reporting it)
    └── Unknown                anything else (wrapped at process edges)

Errors cross process boundaries by ``kind`` (the class name) and message; :func:`from_kind` turns
them back into the same class on the other side.
"""

from __future__ import annotations


class DynamoError(Exception):
    """Base of every error dynamo-py raises on purpose."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    @property
    def kind(self) -> str:
        return type(self).__name__

    def __str__(self) -> str:
        return self.message or self.kind


class InvalidArgument(DynamoError):
    """``param`` names the request field at fault, when one is (the OpenAI error's ``param``)."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(DynamoError):
    pass


class NoInstances(DynamoError):
    pass


class Overloaded(DynamoError):
    pass


class CannotConnect(DynamoError):
    pass


class EngineShutdown(DynamoError):
    pass


class WorkerShutdown(DynamoError):
    pass


class StreamIncomplete(DynamoError):
    pass


class Cancelled(DynamoError):
    pass


class ResponseTimeout(DynamoError):
    pass


class Disconnected(DynamoError):
    pass


class ConnectionTimeout(DynamoError):
    pass


class KVTransferFailed(DynamoError):
    pass


class Unknown(DynamoError):
    pass


_KINDS: dict[str, type[DynamoError]] = {
    cls.__name__: cls
    for cls in (
        DynamoError,
        InvalidArgument,
        ModelNotFound,
        NoInstances,
        Overloaded,
        CannotConnect,
        EngineShutdown,
        WorkerShutdown,
        StreamIncomplete,
        Cancelled,
        ResponseTimeout,
        Disconnected,
        ConnectionTimeout,
        KVTransferFailed,
        Unknown,
    )
}


def from_kind(kind: str, message: str) -> DynamoError:
    """Rebuild an error received from the wire; an unknown kind becomes :class:`Unknown`."""
    cls = _KINDS.get(kind, Unknown)
    return cls(message)


def wrap(exc: BaseException) -> DynamoError:
    """Return ``exc`` if it is a DynamoError, else an :class:`Unknown` carrying its text."""
    if isinstance(exc, DynamoError):
        return exc
    return Unknown(f"{type(exc).__name__}: {exc}")

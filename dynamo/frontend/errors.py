"""The one mapping of errors to an HTTP status and an OpenAI error body.

Every error a client can see goes through :func:`to_http`, so a request never ends in a 500 with a
traceback: unknown exceptions become a 500 with a short message and are logged here (once: a
path that needs the reply twice keeps the first). Malformed JSON (invalid UTF-8, nesting past the
decoder's depth limit) is a 400. Messages never carry internal addresses: ``tcp://host:port`` and
the like (from request-plane errors) are replaced before a client sees them.

Failures of the serving side are told apart by status: no worker to take the request (503,
``service_unavailable``, with Retry-After), the worker's engine went down under it (502,
``engine_unavailable``: ``EngineShutdown``, ``WorkerShutdown``), a stream cut short (502,
``upstream_error``), and a worker that stopped answering (504, ``timeout``: ``ResponseTimeout``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import msgspec

from dynamo.protocol.openai import ErrorDetail, ErrorResponse
from dynamo.runtime import errors as E

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
_PATH = re.compile(r"at `\$\.([A-Za-z0-9_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z0-9_]+)`")
_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"(),]+|\b\d{1,3}(?:\.\d{1,3}){3}:\d+\b")


class HTTPError(Exception):
    """An error raised by the HTTP layer itself (bad route, method, body size, JSON)."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class HTTPErrorReply:
    status: int
    body: bytes
    error_type: str  # metrics label: validation, not_found, overload, unavailable, ...
    headers: tuple[tuple[str, str], ...] = ()


_STATUS_TYPE = {
    400: ("invalid_request_error", "validation"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "validation"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "validation"),
    431: ("invalid_request_error", "validation"),
    499: ("cancelled", "cancelled"),
    500: ("internal_error", "internal"),
    501: ("not_implemented", "not_implemented"),
    502: ("upstream_error", "internal"),
    503: ("service_unavailable", "unavailable"),
    504: ("timeout", "response_timeout"),
    529: ("overloaded", "overload"),
}

_DYNAMO_STATUS: list[tuple[type[E.DynamoError], int]] = [
    (E.InvalidArgument, 400),
    (E.ModelNotFound, 404),
    (E.Overloaded, 529),
    (E.NoInstances, 503),
    (E.CannotConnect, 503),
    (E.EngineShutdown, 502),
    (E.WorkerShutdown, 502),
    (E.Cancelled, 499),
    (E.ResponseTimeout, 504),
    (E.ConnectionTimeout, 504),
    (E.StreamIncomplete, 502),
    (E.Disconnected, 502),
    (E.KVTransferFailed, 502),
]

# (OpenAI error type, metrics label) where the status alone does not say it
_TYPE_OVERRIDE: dict[type[E.DynamoError], tuple[str, str]] = {
    E.EngineShutdown: ("engine_unavailable", "unavailable"),
    E.WorkerShutdown: ("engine_unavailable", "unavailable"),
}

RETRY_AFTER_S = "1"


def _reply(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: tuple[str, str] | None = None,
    retry_after: str | None = None,
) -> HTTPErrorReply:
    err_type, label = kind or _STATUS_TYPE.get(status, ("internal_error", "internal"))
    message = _ADDRESS.sub("<internal>", message)
    body = _encoder.encode(
        ErrorResponse(
            error=ErrorDetail(message=message, type=err_type, param=param, code=code or status)
        )
    )
    headers: tuple[tuple[str, str], ...] = ()
    if status in (503, 529):
        headers = (("retry-after", retry_after or RETRY_AFTER_S),)
    return HTTPErrorReply(status, body, label, headers)


def to_http(exc: BaseException, overload_status: int = 529) -> HTTPErrorReply:
    """Map any exception to the reply a client sees (overload: 529 unless configured 503)."""
    if isinstance(exc, E.Overloaded):
        wait = getattr(exc, "retry_after_s", None)  # load shedding's, from the drain rate
        return _reply(overload_status, str(exc), retry_after=None if wait is None else str(wait))
    if isinstance(exc, HTTPError):
        return _reply(exc.status, exc.message, exc.param)
    if isinstance(exc, msgspec.ValidationError):
        text = str(exc)
        # the top-level field at fault: from the error's path, else the missing field's name
        match = _PATH.search(text) or _MISSING.search(text)
        return _reply(400, f"Validation: {text}", match.group(1) if match else None)
    if isinstance(exc, msgspec.DecodeError | UnicodeDecodeError):
        return _reply(400, f"Validation: malformed JSON body: {exc}")
    if isinstance(exc, RecursionError):
        return _reply(400, "Validation: malformed JSON body: nested too deeply")
    if isinstance(exc, E.ModelNotFound):
        return _reply(404, str(exc), "model", "model_not_found")
    if isinstance(exc, E.DynamoError):
        for cls, status in _DYNAMO_STATUS:
            if isinstance(exc, cls):
                prefix = "Validation: " if status == 400 else ""
                param = exc.param if isinstance(exc, E.InvalidArgument) else None
                return _reply(status, prefix + str(exc), param, kind=_TYPE_OVERRIDE.get(cls))
        return _reply(500, f"internal error: {exc}")
    log.error("unexpected error serving a request", exc_info=exc)
    return _reply(500, f"internal error: {type(exc).__name__}")


def error_payload(exc: BaseException) -> bytes:
    """The JSON body of an error (for an SSE error event after streaming began)."""
    return to_http(exc).body

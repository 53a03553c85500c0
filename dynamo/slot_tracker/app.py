"""The slot tracker's HTTP API (spec 001): routes, JSON bodies, status codes.

Statuses: 200/201 success; 400 malformed JSON (invalid UTF-8 and nesting deeper than the
decoder's limit included) or HTTP, invalid values (block_size or dp_size 0,
DP range overflow, bad peer URL); 404 unknown route, tracker, worker, rank, request or peer;
405 unsupported method; 409 duplicate request, duplicate worker, block-size mismatch, peer routes
while replica sync is off; 413 body over 2 MiB; 415 body not sent as application/json;
422 well-formed JSON of the wrong shape (missing field, wrong type, integer out of range).
Every error body is ``{"error": "..."}``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Annotated
from urllib.parse import parse_qsl

import msgspec

from dynamo import native
from dynamo.router.block_counts import BlockCounts
from dynamo.runtime.http_json import FastRoutes
from dynamo.slot_tracker.registry import Registry, TrackerError
from dynamo.slot_tracker.replica import PeerError, ReplicaSync

log = logging.getLogger(__name__)
_loads = native.load_optional("dynamo.slot_tracker._loads")
"""``potential_loads(trackers, body)`` in C (``_loads.c``), or None: the handler answers all."""

# msgspec bounds stop at int64: the u64 upper bound is checked by hand (_check_u64).
U64 = Annotated[int, msgspec.Meta(ge=0)]
U64_MAX = (1 << 64) - 1
U32 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class RegisterBody(msgspec.Struct):
    worker_id: U64
    model_name: str
    block_size: U32
    dp_start: U32
    dp_size: U32
    tenant_id: str = "default"


class UnregisterBody(msgspec.Struct):
    worker_id: U64
    model_name: str
    tenant_id: str = "default"


class AddBody(msgspec.Struct):
    model_name: str
    request_id: str
    worker_id: U64
    dp_rank: U32
    # Signed 64-bit on the wire. Kept as received: the reinterpretation as u64 is a bijection,
    # so the prefix keys (trie nodes) over these values equal those over the unsigned hashes.
    # A tuple: ActiveSequences keeps it without copying.
    sequence_hashes: tuple[I64, ...]
    tenant_id: str = "default"
    new_isl_tokens: U64 = 0


class LifecycleBody(msgspec.Struct):
    model_name: str
    request_id: str
    tenant_id: str = "default"


class PotentialLoadsBody(msgspec.Struct, gc=False):
    model_name: str
    # Left raw by msgspec and parsed by BlockCounts.prefixes_from_json straight into the table of
    # prefix keys the projection probes: no int objects, no tuple (the endpoint's hot path).
    sequence_hashes: msgspec.Raw
    tenant_id: str = "default"
    new_isl_tokens: U64 = 0


class PeerBody(msgspec.Struct):
    url: str


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_encode = msgspec.json.Encoder().encode
_OK = b'{"status":"ok"}'
_NOT_FOUND = (404, b'{"error":"route not found"}')
_NOT_ALLOWED = (405, b'{"error":"method not allowed"}')
_INTERNAL = (500, b'{"error":"internal error"}')
_JSON = b"application/json"
_NO_REPLICA = "replica sync is disabled"

Handler = Callable[[bytes, "bytes | None", bytes], tuple[int, bytes]]


def _error(status: int, message: str) -> tuple[int, bytes]:
    return status, _encode({"error": message})


def _check_json(content_type: bytes | None) -> None:
    if content_type == _JSON:
        return
    if content_type is not None:
        mime = content_type.split(b";", 1)[0].strip().lower()
        if mime == _JSON or (mime.startswith(b"application/") and mime.endswith(b"+json")):
            return
    raise _HTTPError(415, "Expected request with `Content-Type: application/json`")


def _check_u64(value: int, name: str) -> None:
    if value > U64_MAX:
        raise msgspec.ValidationError(f"Expected `int` <= {U64_MAX} - at `$.{name}`")


def _at_field(message: str, field: str) -> str:
    """Root a parser message's location (``- at `[3]```) at a body field, as msgspec does."""
    if " - at `" in message:
        return message.replace(" - at `", f" - at `$.{field}", 1)
    return f"{message} - at `$.{field}`"


def _filters(query: bytes) -> tuple[str | None, str | None]:
    if not query:
        return None, None
    params = dict(parse_qsl(query.decode("utf-8", "replace"), keep_blank_values=True))
    return params.get("model_name"), params.get("tenant_id")


class SlotTrackerApp:
    """Routes requests to the registry (and the replica sync, when enabled). Never raises.

    ``fast_routes``: POST /potential_loads in C when ``_loads`` is built (the same answers as
    ``potential_loads``; anything it does not take, errors included, falls to ``handle``).
    """

    def __init__(self, registry: Registry, replica: ReplicaSync | None = None) -> None:
        self._registry = registry
        self._replica = replica
        self._register = msgspec.json.Decoder(RegisterBody).decode
        self._unregister = msgspec.json.Decoder(UnregisterBody).decode
        self._add = msgspec.json.Decoder(AddBody).decode
        self._lifecycle = msgspec.json.Decoder(LifecycleBody).decode
        self._potential = msgspec.json.Decoder(PotentialLoadsBody).decode
        self._peer = msgspec.json.Decoder(PeerBody).decode
        self._routes: dict[bytes, dict[bytes, Handler]] = {
            b"/register": {b"POST": self.register},
            b"/unregister": {b"POST": self.unregister},
            b"/workers": {b"GET": self.workers},
            b"/add": {b"POST": self.add},
            b"/prefill_complete": {b"POST": self.prefill_complete},
            b"/free": {b"POST": self.free},
            b"/loads": {b"GET": self.loads},
            b"/potential_loads": {b"POST": self.potential_loads},
            b"/register_peer": {b"POST": self.register_peer},
            b"/deregister_peer": {b"POST": self.deregister_peer},
            b"/peers": {b"GET": self.peers},
            b"/health": {b"GET": self.health},
        }
        self.fast_routes: FastRoutes = {}
        if _loads is not None:
            route = functools.partial(_loads.potential_loads, registry.trackers_by_key)
            self.fast_routes[b"/potential_loads"] = route

    def handle(
        self, method: bytes, path: bytes, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes]:
        route = self._routes.get(path)
        if route is None:
            return _NOT_FOUND
        handler = route.get(method)
        if handler is None:
            return _NOT_ALLOWED
        try:
            if method == b"POST" and content_type != _JSON:  # every POST body is JSON
                _check_json(content_type)
            return handler(query, content_type, body)
        except TrackerError as exc:
            return _error(exc.status, exc.message)
        except PeerError as exc:
            return _error(exc.status, exc.message)
        except _HTTPError as exc:
            return _error(exc.status, exc.message)
        except msgspec.ValidationError as exc:
            return _error(422, f"Failed to deserialize the JSON body into the target type: {exc}")
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"Failed to parse the request body as JSON: {exc}")
        except RecursionError:
            return _error(400, "Failed to parse the request body as JSON: nested too deeply")
        except Exception:
            log.exception("slot tracker handler failed: %s %s", method, path)
            return _INTERNAL

    # ------------------------------------------------------------------ topology

    def register(self, query: bytes, content_type: bytes | None, body: bytes) -> tuple[int, bytes]:
        req = self._register(body)
        _check_u64(req.worker_id, "worker_id")
        self._registry.register(
            (req.model_name, req.tenant_id),
            req.worker_id,
            req.block_size,
            req.dp_start,
            req.dp_size,
        )
        return 201, _OK

    def unregister(
        self, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes]:
        req = self._unregister(body)
        _check_u64(req.worker_id, "worker_id")
        self._registry.unregister((req.model_name, req.tenant_id), req.worker_id)
        return 200, _OK

    def workers(self, query: bytes, content_type: bytes | None, body: bytes) -> tuple[int, bytes]:
        return 200, _encode(self._registry.list_workers(*_filters(query)))

    # ----------------------------------------------------------------- lifecycle

    def add(self, query: bytes, content_type: bytes | None, body: bytes) -> tuple[int, bytes]:
        req = self._add(body)
        if req.worker_id > U64_MAX or req.new_isl_tokens > U64_MAX:
            _check_u64(req.worker_id, "worker_id")
            _check_u64(req.new_isl_tokens, "new_isl_tokens")
        self._registry.add(
            (req.model_name, req.tenant_id),
            req.request_id,
            req.worker_id,
            req.dp_rank,
            req.sequence_hashes,
            req.new_isl_tokens,
        )
        return 201, _OK

    def prefill_complete(
        self, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes]:
        req = self._lifecycle(body)
        self._registry.prefill_complete((req.model_name, req.tenant_id), req.request_id)
        return 200, _OK

    def free(self, query: bytes, content_type: bytes | None, body: bytes) -> tuple[int, bytes]:
        req = self._lifecycle(body)
        self._registry.free((req.model_name, req.tenant_id), req.request_id)
        return 200, _OK

    # --------------------------------------------------------------------- loads

    def loads(self, query: bytes, content_type: bytes | None, body: bytes) -> tuple[int, bytes]:
        return 200, _encode(self._registry.loads(*_filters(query)))

    def potential_loads(
        self, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes]:
        req = self._potential(body)
        if req.new_isl_tokens > U64_MAX:
            _check_u64(req.new_isl_tokens, "new_isl_tokens")
        try:
            blocks = BlockCounts.prefixes_from_json(req.sequence_hashes)
        except ValueError as exc:
            raise msgspec.ValidationError(_at_field(str(exc), "sequence_hashes")) from None
        loads = self._registry.potential_loads(
            (req.model_name, req.tenant_id), blocks, req.new_isl_tokens
        )
        return 200, _encode(loads)

    # --------------------------------------------------------------------- peers

    def register_peer(
        self, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes]:
        req = self._peer(body)
        if self._replica is None:
            return _error(409, _NO_REPLICA)
        return (201 if self._replica.register_peer(req.url) else 200), _OK

    def deregister_peer(
        self, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes]:
        req = self._peer(body)
        if self._replica is None:
            return _error(409, _NO_REPLICA)
        if not self._replica.deregister_peer(req.url):
            return _error(404, "peer not found")
        return 200, _OK

    def peers(self, query: bytes, content_type: bytes | None, body: bytes) -> tuple[int, bytes]:
        return 200, _encode(self._replica.peers() if self._replica is not None else [])

    def health(self, query: bytes, content_type: bytes | None, body: bytes) -> tuple[int, bytes]:
        return 200, b""

"""OTLP trace export of :class:`~dynamo.observability.recording.RecordedSpan` s: protobuf
encoding (``otlp_wire.py``), the two transports and the batching thread.

Configured by the standard settings, as the OpenTelemetry Python SDK reads them:
``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` (``grpc``, the default as in the reference, or
``http/protobuf``), ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` (gRPC default
``http://localhost:4317``; HTTP default ``http://localhost:4318/v1/traces``, the generic endpoint
gets ``/v1/traces`` appended), ``..._HEADERS`` (``k=v,k2=v2``, URL-encoded values),
``..._COMPRESSION`` (``gzip`` or ``none``), ``..._TIMEOUT`` (seconds, the SDK's unit),
``..._CERTIFICATE`` (CA file for TLS), ``..._INSECURE`` (gRPC without a scheme); the batch by
``OTEL_BSP_SCHEDULE_DELAY`` (ms), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``,
``OTEL_BSP_MAX_QUEUE_SIZE`` and ``OTEL_BSP_EXPORT_TIMEOUT`` (ms).

Why not the SDK's exporters: their encoder builds a protobuf object per span and attribute
and dumps the resource to JSON once per span to group spans by resource, ~60 us a span on the
2-core VM; this one writes the wire format directly (one resource and scope per batch; attribute
keys encoded once), ~10 us a span. The batch is encoded and sent on the export thread: what the
request path pays is appending the ended span to a deque.
"""

from __future__ import annotations

import gzip
import http.client
import logging
import os
import ssl
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from dynamo.observability.otlp_wire import Encoder as Encoder  # re-exported: the exporter takes one
from dynamo.observability.recording import RecordedSpan

log = logging.getLogger(__name__)

GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_RETRYABLE_HTTP = {429, 502, 503, 504}


# -- settings ------------------------------------------------------------------------------
def _setting(name: str, default: str = "") -> str:
    """``OTEL_EXPORTER_OTLP_TRACES_{name}``, else ``OTEL_EXPORTER_OTLP_{name}``."""
    env = os.environ
    value = env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}")
    return (value or default).strip()


def _headers() -> list[tuple[str, str]]:
    out = []
    for item in _setting("HEADERS").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out.append((key.strip().lower(), urllib.parse.unquote(value.strip())))
    return out


def _gzip() -> bool:
    compression = _setting("COMPRESSION", "none").lower()
    if compression not in ("gzip", "none"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_COMPRESSION={compression!r} (gzip or none)")
    return compression == "gzip"


def _timeout_s() -> float:
    return float(_setting("TIMEOUT", "10"))


def protocol() -> str:
    value = _setting("PROTOCOL", "grpc")
    if value not in ("grpc", "http/protobuf"):
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={value!r} is not supported (grpc or http/protobuf)"
        )
    return value


class Transport(Protocol):
    def send(self, body: bytes, deadline: float) -> bool:
        """Deliver one encoded batch before ``deadline`` (monotonic); False if it was lost."""

    def close(self) -> None: ...


class HttpTransport:
    """OTLP/HTTP with protobuf bodies over one kept-alive connection."""

    def __init__(self) -> None:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        if not endpoint:
            base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
            endpoint = base.rstrip("/") + "/v1/traces" if base else ""
        url = urllib.parse.urlsplit(endpoint or "http://localhost:4318/v1/traces")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"OTLP/HTTP endpoint {endpoint!r} is not an http(s) URL")
        self.url = url
        self.path = url.path or "/v1/traces"
        self.gzip = _gzip()
        self.timeout_s = _timeout_s()
        self.headers = dict(_headers())
        self.headers["content-type"] = "application/x-protobuf"
        if self.gzip:
            self.headers["content-encoding"] = "gzip"
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        url = self.url
        if url.scheme == "https":
            cafile = _setting("CERTIFICATE") or None
            tls = ssl.create_default_context(cafile=cafile)
            return http.client.HTTPSConnection(
                url.hostname or "", url.port, timeout=timeout, context=tls
            )
        return http.client.HTTPConnection(url.hostname or "", url.port, timeout=timeout)

    def send(self, body: bytes, deadline: float) -> bool:
        if self.gzip:
            body = gzip.compress(body, compresslevel=1)
        delay = 0.5
        while True:
            timeout = max(0.1, min(self.timeout_s, deadline - time.monotonic()))
            status = self._post(body, timeout)
            if status is not None and 200 <= status < 300:
                return True
            if status is not None and status not in _RETRYABLE_HTTP:
                log.warning("OTLP export refused: HTTP %d (%d bytes dropped)", status, len(body))
                return False
            if time.monotonic() + delay >= deadline:
                return False
            time.sleep(delay)
            delay *= 2

    def _post(self, body: bytes, timeout: float) -> int | None:
        for attempt in (1, 2):  # a kept-alive connection the receiver closed: reconnect once
            if self._conn is None:
                self._conn = self._connect(timeout)
            conn = self._conn
            try:
                conn.timeout = timeout
                conn.request("POST", self.path, body, self.headers)
                response = conn.getresponse()
                response.read()
                if response.will_close:
                    self.close()
                return response.status
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt == 2:
                    return None
        return None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class GrpcTransport:
    """OTLP/gRPC: the ``TraceService/Export`` unary call with the encoded bytes as the
    message (no protobuf objects)."""

    def __init__(self) -> None:
        import grpc  # type: ignore[import-untyped]  # the ``otlp`` extra

        self._grpc = grpc
        endpoint = _setting("ENDPOINT", "http://localhost:4317")
        url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
        if not url.hostname:
            raise ValueError(f"OTLP/gRPC endpoint {endpoint!r} has no host")
        target = f"{url.hostname}:{url.port or 4317}"
        if url.scheme == "https":
            secure = True
        elif url.scheme == "http":
            secure = False
        else:
            secure = _setting("INSECURE", "false").lower() not in ("true", "1")
        compression = grpc.Compression.Gzip if _gzip() else grpc.Compression.NoCompression
        if secure:
            ca = _setting("CERTIFICATE")
            root = open(ca, "rb").read() if ca else None  # noqa: SIM115 - read once at start
            creds = grpc.ssl_channel_credentials(root_certificates=root)
            self._channel = grpc.secure_channel(target, creds, compression=compression)
        else:
            self._channel = grpc.insecure_channel(target, compression=compression)
        self._export = self._channel.unary_unary(
            GRPC_METHOD, request_serializer=None, response_deserializer=None
        )
        self.metadata = tuple(_headers())
        self.timeout_s = _timeout_s()
        self._retryable = {
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.ABORTED,
            grpc.StatusCode.CANCELLED,
        }

    def send(self, body: bytes, deadline: float) -> bool:
        delay = 0.5
        while True:
            timeout = max(0.1, min(self.timeout_s, deadline - time.monotonic()))
            try:
                self._export(body, timeout=timeout, metadata=self.metadata)
                return True
            except self._grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code not in self._retryable:
                    log.warning("OTLP export refused: %s (%d bytes dropped)", code, len(body))
                    return False
            if time.monotonic() + delay >= deadline:
                return False
            time.sleep(delay)
            delay *= 2

    def close(self) -> None:
        self._channel.close()


def transport() -> Transport:
    """The transport the settings name (raises ``ValueError`` for a bad setting, and when
    gRPC is asked for without ``grpcio``: the ``otlp`` extra)."""
    if protocol() == "http/protobuf":
        return HttpTransport()
    try:
        return GrpcTransport()
    except ImportError as exc:
        raise ValueError(
            f"OTLP over gRPC needs grpcio (pip install 'dynamo-py[otlp]'): {exc}"
        ) from None


# -- batching ------------------------------------------------------------------------------
def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


class BatchExporter:
    """Ended spans queue here (bounded: beyond ``max_queue`` they are dropped and counted);
    a daemon thread encodes and sends them every ``delay_s`` or as soon as a batch is full.
    :meth:`shutdown` sends what is queued (process exit)."""

    def __init__(
        self,
        encoder: Encoder,
        transport: Transport,
        *,
        delay_s: float | None = None,
        max_batch: int | None = None,
        max_queue: int | None = None,
        export_timeout_s: float | None = None,
    ) -> None:
        self.encoder = encoder
        self.transport = transport
        self.delay_s = (
            delay_s if delay_s is not None else _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        )
        self.max_batch = max_batch or _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
        self.max_queue = max_queue or _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.export_timeout_s = (
            export_timeout_s
            if export_timeout_s is not None
            else _env_int("OTEL_BSP_EXPORT_TIMEOUT", 30000) / 1000
        )
        if self.max_batch < 1 or self.max_queue < self.max_batch or self.delay_s <= 0:
            raise ValueError("OTEL_BSP_*: need 0 < delay, 1 <= batch size <= queue size")
        self.exported = 0
        self.dropped = 0
        self._queue: deque[RecordedSpan] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    def add(self, span: RecordedSpan) -> None:
        """The span sink (any thread): queue, or count a drop when the queue is full."""
        queue = self._queue
        n = len(queue)
        if n >= self.max_queue:
            self.dropped += 1
            return
        queue.append(span)
        if n + 1 == self.max_batch:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._drain()

    def _drain(self, until: float | None = None) -> None:
        """Send the queue in batches, each within the export timeout (and before ``until``:
        past it, what is left is dropped)."""
        queue = self._queue
        while queue:
            batch = [queue.popleft() for _ in range(min(self.max_batch, len(queue)))]
            deadline = time.monotonic() + self.export_timeout_s
            if until is not None:
                if time.monotonic() >= until:
                    self.dropped += len(batch)
                    continue
                deadline = min(deadline, until)
            self._send(batch, deadline)

    def _send(self, batch: Sequence[RecordedSpan], deadline: float) -> None:
        try:
            body = self.encoder.encode(batch)
            delivered = self.transport.send(body, deadline)
        except Exception:
            log.exception("OTLP export failed")
            delivered = False
        if delivered:
            self.exported += len(batch)
        else:
            self.dropped += len(batch)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, send what is queued, close the transport; all within ``timeout_s``
        (an unreachable collector must not hold the process's exit for the export timeout).
        Idempotent."""
        if self._stopping:
            return
        until = time.monotonic() + timeout_s
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # else it is still sending: leave the queue to it
            self._drain(until)
        self.transport.close()

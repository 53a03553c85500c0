"""Local OTLP trace receivers for tests and benchmarks: OTLP/HTTP (``POST /v1/traces``,
protobuf, optionally gzip) and OTLP/gRPC (``TraceService/Export``), the received spans and the
request headers (gRPC metadata) kept in memory. Decoded with the official OTLP message classes,
so they check our encoder too."""

from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    error: bool


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _Received:
    """What a receiver got: spans, and the headers of each export request."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests: list[ExportTraceServiceRequest] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def _add(self, req: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        got: list[ReceivedSpan] = []
        for rs in req.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=[(lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links],
                            error=s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )
        with self._lock:
            self.spans.extend(got)
            self.requests.append(req)
            self.headers.append(headers)

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans of ``trace_id`` once every one of ``names`` arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = [s for s in self.spans if s.trace_id == trace_id]
            if names <= {s.name for s in found}:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"spans of {trace_id}: {sorted(s.name for s in found)}")
            time.sleep(0.05)


class OtlpReceiver(_Received):
    """OTLP/HTTP, started on 127.0.0.1 with an ephemeral port; :meth:`close` stops it."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as collectors do

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                data = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    data = gzip.decompress(data)
                req = ExportTraceServiceRequest()
                req.ParseFromString(data)
                receiver._add(req, {k.lower(): v for k, v in self.headers.items()})
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcOtlpReceiver(_Received):
    """OTLP/gRPC (plaintext), started on 127.0.0.1 with an ephemeral port."""

    def __init__(self) -> None:
        import grpc  # type: ignore[import-untyped]

        super().__init__()

        def export(req: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
            self._add(req, dict(context.invocation_metadata()))
            return ExportTraceServiceResponse()

        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {
                "Export": grpc.unary_unary_rpc_method_handler(
                    export,
                    request_deserializer=ExportTraceServiceRequest.FromString,
                    response_serializer=ExportTraceServiceResponse.SerializeToString,
                )
            },
        )
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.stop(grace=None).wait(5)

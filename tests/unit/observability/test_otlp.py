"""OTLP export of recorded spans: the protobuf our encoder writes, read back with the official
OTLP classes; both transports against receivers started here (headers, gzip); the batch queue's
bound; the samplers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as PbStatus
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
)

from dynamo.observability import otlp
from dynamo.observability.recording import RecordedSpan, RecordingTracer, Sampler
from tests.otlp_receiver import GrpcOtlpReceiver, OtlpReceiver, _value

REMOTE = SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True, TraceFlags(TraceFlags.SAMPLED)
)


def recorded(sampler: Sampler | None = None) -> tuple[RecordingTracer, list[RecordedSpan]]:
    ended: list[RecordedSpan] = []
    return RecordingTracer(ended.append, sampler or Sampler()), ended


def one_trace(tracer: RecordingTracer) -> None:
    """A remote parent, a server span with every attribute type, an event, an error, a link."""
    parent = trace.set_span_in_context(NonRecordingSpan(REMOTE))
    root = tracer.start_span("http-request", parent, SpanKind.SERVER, {"request_id": "r1"})
    root.set_attributes({"flag": True, "off": False, "n": -5, "big": 2**62, "ratio": 0.25})
    root.set_attribute("tags", ["a", "b"])
    root.set_attribute("sizes", [1, 2])
    root.add_event("queued", {"depth": 3})
    child = tracer.start_span(
        "engine.generate",
        trace.set_span_in_context(root),
        links=[Link(REMOTE, {"link.kind": "predecessor"})],
    )
    child.set_status(StatusCode.ERROR, "Unknown: boom")
    child.end()
    root.end()
    root.set_attribute("late", 1)  # after the end: ignored


def test_the_encoding_reads_back_with_the_official_classes() -> None:
    tracer, ended = recorded()
    one_trace(tracer)
    body = otlp.Encoder({"service.name": "svc", "pid": 7}).encode(ended)
    req = ExportTraceServiceRequest.FromString(body)
    (rs,) = req.resource_spans
    assert {a.key: _value(a.value) for a in rs.resource.attributes} == {
        "service.name": "svc",
        "pid": 7,
    }
    (ss,) = rs.scope_spans
    assert ss.scope.name == "dynamo"
    gen, root = ss.spans
    assert root.name == "http-request" and root.kind == PbSpan.SPAN_KIND_SERVER
    assert root.trace_id == REMOTE.trace_id.to_bytes(16, "big")
    assert root.parent_span_id == REMOTE.span_id.to_bytes(8, "big")
    assert root.flags == 0x301  # sampled; the parent's remoteness known, and remote
    assert 0 < root.start_time_unix_nano <= root.end_time_unix_nano
    attrs = {a.key: a.value for a in root.attributes}
    assert {k: _value(v) for k, v in attrs.items() if k not in ("tags", "sizes")} == {
        "request_id": "r1",
        "flag": True,
        "off": False,
        "n": -5,
        "big": 2**62,
        "ratio": 0.25,
    }
    assert [v.string_value for v in attrs["tags"].array_value.values] == ["a", "b"]
    assert [v.int_value for v in attrs["sizes"].array_value.values] == [1, 2]
    (event,) = root.events
    assert event.name == "queued" and event.attributes[0].value.int_value == 3
    assert root.status.code == PbStatus.STATUS_CODE_UNSET
    assert gen.parent_span_id == root.span_id and gen.trace_id == root.trace_id
    assert gen.kind == PbSpan.SPAN_KIND_INTERNAL and gen.flags == 0x101
    assert gen.status.code == PbStatus.STATUS_CODE_ERROR
    assert gen.status.message == "Unknown: boom"
    (link,) = gen.links
    assert link.span_id == REMOTE.span_id.to_bytes(8, "big")
    assert link.attributes[0].key == "link.kind"


def test_cached_attribute_fields_read_back_by_type() -> None:
    """The encoder caches a (key, value) field per type: the same key with a bool, an int, a
    string and a float must each read back as what was set, the second time too."""
    tracer, ended = recorded()
    values: list[object] = [True, 1, "1", 1.0, 0, False, -1, 70000, 2.5]
    for value in [*values, *values]:
        tracer.start_span("s", attributes={"a": value}).end()
    body = otlp.Encoder({}).encode(ended)
    spans = ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans
    read = [_value(span.attributes[0].value) for span in spans]
    assert read == [*values, *values]
    assert [type(v) for v in read] == [type(v) for v in [*values, *values]]


def test_a_root_span_has_no_parent_field() -> None:
    tracer, ended = recorded()
    tracer.start_span("root").end()
    (span,) = (
        ExportTraceServiceRequest.FromString(otlp.Encoder({}).encode(ended))
        .resource_spans[0]
        .scope_spans[0]
        .spans
    )
    assert span.parent_span_id == b"" and len(span.span_id) == 8 and span.flags == 0x101


@pytest.fixture
def http_receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


def test_http_protobuf_with_headers_and_gzip(
    monkeypatch: pytest.MonkeyPatch, http_receiver: OtlpReceiver
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{http_receiver.port}/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=a%20b,authorization=Bearer t")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    transport = otlp.transport()
    assert isinstance(transport, otlp.HttpTransport) and transport.path == "/v1/traces"
    exporter = otlp.BatchExporter(otlp.Encoder({"service.name": "t"}), transport, delay_s=60)
    tracer, _ = recorded()
    tracer._sink = exporter.add  # noqa: SLF001 - straight into the exporter, as tracing does
    for _ in range(3):
        one_trace(tracer)
    exporter.shutdown()  # sends what is queued
    assert exporter.exported == 6 and exporter.dropped == 0
    assert len(http_receiver.spans) == 6
    headers = http_receiver.headers[-1]
    assert headers["x-tenant"] == "a b" and headers["authorization"] == "Bearer t"
    assert headers["content-encoding"] == "gzip"


def test_grpc_with_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = GrpcOtlpReceiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=grpc")
        transport = otlp.transport()  # grpc: the default protocol
        assert isinstance(transport, otlp.GrpcTransport)
        exporter = otlp.BatchExporter(otlp.Encoder({"service.name": "g"}), transport, delay_s=60)
        tracer, _ = recorded()
        tracer._sink = exporter.add  # noqa: SLF001
        one_trace(tracer)
        exporter.shutdown()
        assert exporter.exported == 2
        assert {s.name for s in receiver.spans} == {"http-request", "engine.generate"}
        assert receiver.headers[-1]["x-tenant"] == "grpc"
        assert {s.service for s in receiver.spans} == {"g"}
    finally:
        receiver.close()


class _HeldTransport:
    """Blocks in ``send`` until released (the export thread is busy)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.sent: list[bytes] = []

    def send(self, body: bytes, deadline: float) -> bool:
        self.entered.set()
        assert self.release.wait(10)
        self.sent.append(body)
        return True

    def close(self) -> None:
        pass


def test_a_full_queue_drops_and_counts_instead_of_growing() -> None:
    held = _HeldTransport()
    exporter = otlp.BatchExporter(
        otlp.Encoder({}), held, delay_s=60, max_batch=2, max_queue=4, export_timeout_s=5
    )
    tracer, _ = recorded()
    tracer._sink = exporter.add  # noqa: SLF001
    for _ in range(2):  # a full batch wakes the thread, which then blocks sending it
        tracer.start_span("s").end()
    assert held.entered.wait(10)
    for _ in range(5):  # the queue holds 4 more; the fifth is dropped
        tracer.start_span("s").end()
    assert exporter.dropped == 1
    held.release.set()
    exporter.shutdown()
    assert exporter.exported == 6 and exporter.dropped == 1


def test_an_unreachable_collector_loses_the_batch_within_the_timeout() -> None:
    http = OtlpReceiver()
    port = http.port
    http.close()  # nothing listens there any more
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        mp.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}/v1/traces")
        exporter = otlp.BatchExporter(otlp.Encoder({}), otlp.transport(), export_timeout_s=0.3)
    tracer, _ = recorded()
    tracer._sink = exporter.add  # noqa: SLF001
    tracer.start_span("s").end()
    exporter.shutdown()
    assert exporter.exported == 0 and exporter.dropped == 1
    # At exit, the shutdown's own bound wins over a long export timeout.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        mp.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}/v1/traces")
        exporter = otlp.BatchExporter(
            otlp.Encoder({}), otlp.transport(), delay_s=60, export_timeout_s=60
        )
    tracer._sink = exporter.add  # noqa: SLF001
    tracer.start_span("s").end()
    began = time.monotonic()
    exporter.shutdown(timeout_s=0.5)  # the export thread is retrying: not waited for
    assert time.monotonic() - began < 30  # generous: the point is "not the 60 s timeout"
    assert exporter.exported == 0


def test_bad_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        otlp.transport()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "brotli")
    with pytest.raises(ValueError, match="brotli"):
        otlp.transport()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        Sampler.from_env()


def test_samplers() -> None:
    unsampled = trace.set_span_in_context(
        NonRecordingSpan(SpanContext(REMOTE.trace_id, REMOTE.span_id, True))
    )
    tracer, ended = recorded()
    child = tracer.start_span("child", unsampled)  # parent-based: follows the parent
    assert not child.is_recording()
    assert child.get_span_context().trace_id == REMOTE.trace_id
    tracer.start_span("root").end()
    assert [s.name for s in ended] == ["root"]
    never, ended = recorded(Sampler("traceidratio", 0.0))
    for _ in range(20):
        never.start_span("r").end()
    assert ended == []
    always, ended = recorded(Sampler("always_on"))
    always.start_span("child", unsampled).end()  # not parent-based: records anyway
    assert len(ended) == 1

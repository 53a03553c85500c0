"""OpenTelemetry tracing of every process: one tracer provider, W3C context over the request
plane, links between the attempts of a request.

Spans always exist (so log lines carry a trace id, see ``logging.py``); they leave the process
only when ``OTEL_EXPORT_ENABLED=1``, over OTLP configured by the standard settings
(``OTEL_EXPORTER_OTLP_PROTOCOL`` = ``grpc`` (default, as the reference) or ``http/protobuf``,
``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, ``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS``, ...;
``OTEL_SERVICE_NAME`` overrides the process's service name). Per-chunk recording (inter-token
latencies on ``engine.generate``) happens only while spans are exported somewhere
(:func:`recording`): otherwise nobody would read it.

The trace context crosses the request plane in ``PreprocessedRequest.traceparent`` (a W3C
``traceparent`` header value): :func:`traceparent` writes it, :func:`parent_context` reads it.

Cross-worker links (prefill -> decode, a migrated attempt -> the previous one): the worker stamps
its ``engine.generate`` span's ids on the first chunk it sends (``LLMEngineOutput.
worker_trace_link``); whoever starts the successor request passes that link on with
:func:`with_predecessor`, and the successor's ``engine.generate`` span carries an OTel link to it
(plus ``migration_trace_id``/``migration_span_id`` attributes), see :func:`links_of`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import Token
from typing import Any

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dynamo.protocol.request import PreprocessedRequest, TraceLink

EXPORT_ENV = "OTEL_EXPORT_ENABLED"
_TRUE = {"1", "true", "yes", "on"}
_propagator = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None
_recording = False


def export_enabled() -> bool:
    return os.environ.get(EXPORT_ENV, "").strip().lower() in _TRUE


def setup_tracing(service_name: str) -> TracerProvider:
    """Install this process's tracer provider (once; later calls return it) and, when
    ``OTEL_EXPORT_ENABLED=1``, its OTLP exporter. Raises ``ValueError`` for an unknown
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` or when the exporter is not installed (the ``otlp``
    extra)."""
    global _provider
    if _provider is not None:
        return _provider
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if export_enabled():
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        _set_recording()
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def _otlp_exporter() -> Any:
    try:
        return _exporter_for_protocol()
    except ImportError as exc:
        raise ValueError(
            f"{EXPORT_ENV}=1 needs the OTLP exporters (pip install 'dynamo-py[otlp]'): {exc}"
        ) from None


def _exporter_for_protocol() -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported (grpc or http/protobuf)"
    )


def add_span_processor(processor: SpanProcessor, service_name: str = "dynamo") -> None:
    """Send spans to ``processor`` too (an in-memory exporter in tests); recording goes on."""
    setup_tracing(service_name).add_span_processor(processor)
    _set_recording()


def _set_recording() -> None:
    global _recording
    _recording = True


def recording() -> bool:
    """Whether spans go anywhere (an exporter or an added processor): per-chunk work is done
    only then."""
    return _recording


def shutdown_tracing() -> None:
    """Flush and stop the exporters (process exit)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    """The tracer every dynamo span comes from (the provider is set up on first use).

    While nothing records (:func:`recording`), spans are local only: valid ids that continue
    the parent's trace (so log lines carry the trace id and the request carries a
    ``traceparent`` a downstream process that does export continues), without the SDK's per-span
    bookkeeping. ``OTEL_SDK_DISABLED=true`` turns even those off."""
    global _tracer
    if _tracer is None:
        provider = setup_tracing("dynamo")
        _tracer = provider.get_tracer("dynamo")  # built once: get_tracer is slow
    if _recording or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return _tracer
    return _LOCAL


class _LocalTracer(trace.Tracer):
    """Spans with ids and nothing else (see :func:`tracer`)."""

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> Span:
        parent = trace.get_current_span(context).get_span_context()
        if parent.is_valid:
            trace_id, flags = parent.trace_id, parent.trace_flags
        else:
            trace_id, flags = _random.getrandbits(128) or 1, _SAMPLED
        span_id = _random.getrandbits(64) or 1
        return NonRecordingSpan(SpanContext(trace_id, span_id, False, flags))

    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> _LocalScope:
        return _LocalScope(self.start_span(name, context))


class _LocalScope:
    """``with``: a local span current for the block. A plain class, not ``@contextmanager`` over
    ``trace.use_span`` (two generator frames and the SDK's exception bookkeeping for a span
    that records nothing): a request opens two of these (preprocess, route)."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Span) -> None:
        self._span = span
        self._token: Token[Context] | None = None

    def __enter__(self) -> Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            otel_context.detach(self._token)


_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_random = random.Random()
_LOCAL = _LocalTracer()


# -- context across processes ----------------------------------------------------------------
def context_from_headers(headers: Mapping[str, str]) -> Context:
    """The parent context of an incoming HTTP request (its W3C ``traceparent``, if any)."""
    return _propagator.extract(headers)


def traceparent(span: Span | None = None) -> str | None:
    """The W3C ``traceparent`` value naming ``span`` (default: the current span), or None."""
    ctx = (span or trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parent_context(value: str | None) -> Context | None:
    """The context a ``traceparent`` value names (None: start a new trace)."""
    if not value:
        return None
    return _propagator.extract({"traceparent": value})


def with_traceparent(request: PreprocessedRequest, span: Span | None = None) -> PreprocessedRequest:
    """``request`` carrying the current span's (or ``span``'s) trace context; the caller's
    struct is not mutated."""
    value = traceparent(span)
    if value is None or value == request.traceparent:
        return request
    return msgspec.structs.replace(request, traceparent=value)


# -- links between attempts --------------------------------------------------------------------
def link_of(span: Span) -> TraceLink | None:
    """The link a successor request carries to ``span`` (None for an invalid span)."""
    return link_of_context(span.get_span_context())


def link_of_context(ctx: SpanContext) -> TraceLink | None:
    if not ctx.is_valid:
        return None
    return TraceLink(trace_id=f"{ctx.trace_id:032x}", span_id=f"{ctx.span_id:016x}")


def with_predecessor(request: PreprocessedRequest, link: TraceLink | None) -> PreprocessedRequest:
    """``request`` as the successor of the attempt ``link`` names: a decode request after its
    prefill (pass the prefill stream's ``worker_trace_link``), or a migration retry after the
    attempt that failed. Its ``engine.generate`` span will link back. Not mutated; ``None``
    leaves it as it is."""
    if link is None or link == request.migration_link:
        return request
    return msgspec.structs.replace(request, migration_link=link)


def links_of(request: PreprocessedRequest) -> list[Link]:
    """The OTel links of a request's ``engine.generate`` span (its predecessor, if any)."""
    link = request.migration_link
    if link is None:
        return []
    try:
        ctx = SpanContext(
            trace_id=int(link.trace_id, 16),
            span_id=int(link.span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
    except ValueError:  # a malformed link from a peer must not fail the request
        return []
    return [Link(ctx, {"link.kind": "predecessor"})] if ctx.is_valid else []


@contextmanager
def use(span: Span) -> Iterator[None]:
    """Make ``span`` current for a synchronous block (log lines in it carry its trace id).
    Never hold it across an ``await``/``yield``: the context must be restored where it was set."""
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


def in_span(span: Span) -> Context:
    """A context whose current span is ``span`` (the parent of explicitly started children)."""
    return trace.set_span_in_context(span)


__all__ = [
    "add_span_processor",
    "context_from_headers",
    "export_enabled",
    "in_span",
    "link_of",
    "links_of",
    "parent_context",
    "recording",
    "setup_tracing",
    "shutdown_tracing",
    "traceparent",
    "tracer",
    "use",
    "with_predecessor",
    "with_traceparent",
]

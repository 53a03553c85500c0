"""OpenTelemetry tracing of every process: one tracer, W3C context over the request plane,
links between the attempts of a request.

Spans always exist (so log lines carry a trace id, see ``logging.py``); they leave the process
only when ``OTEL_EXPORT_ENABLED=1``, over OTLP configured by the standard settings (``otlp.py``:
``OTEL_EXPORTER_OTLP_PROTOCOL`` = ``grpc`` (default, as the reference) or ``http/protobuf``,
``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, ``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS``, ...;
``OTEL_SERVICE_NAME`` overrides the process's service name). Recorded spans are dynamo's own
implementation of the OpenTelemetry span API (``recording.py``: the SDK's spans and encoder cost
1.4x the CPU of a request); SDK span processors can still be added (:func:`add_span_processor`).
Per-chunk recording (inter-token
latencies on ``engine.generate``) happens only while spans are exported somewhere
(:func:`recording`): otherwise nobody would read it.

The trace context crosses the request plane in ``PreprocessedRequest.traceparent`` (a W3C
``traceparent`` header value): :func:`traceparent` writes it, :func:`remote_parent` (the
worker's spans, :func:`start_child`) and :func:`parent_context` read it.

Cross-worker links (prefill -> decode, a migrated attempt -> the previous one): the worker stamps
its ``engine.generate`` span's ids on the first chunk it sends (``LLMEngineOutput.
worker_trace_link``); whoever starts the successor request passes that link on with
:func:`with_predecessor`, and the successor's ``engine.generate`` span carries an OTel link to it
(plus ``migration_trace_id``/``migration_span_id`` attributes), see :func:`links_of`.
"""

from __future__ import annotations

import atexit
import os
import random
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event as SdkEvent
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import INVALID_SPAN, Link, NonRecordingSpan, Span, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from dynamo.observability import otlp
from dynamo.observability.recording import RecordedSpan, RecordingTracer, Sampler
from dynamo.observability.span_context import (
    FLAGS,
    SAMPLED,
    SpanScope,
    attach,
    detach,
    new_span_context,
    parent_of,
    remote_context,
    span_context,
    with_span,
)
from dynamo.protocol.request import PreprocessedRequest, TraceLink

EXPORT_ENV = "OTEL_EXPORT_ENABLED"
_TRUE = {"1", "true", "yes", "on"}
_propagator = TraceContextTextMapPropagator()


class _State:
    """This process's tracing set-up (module state: one per process)."""

    def __init__(self) -> None:
        self.configured = False
        self.disabled = False  # OTEL_SDK_DISABLED, read once at set-up (not per span)
        self.resource: dict[str, Any] = {}
        self.sampler = Sampler()
        self.exporter: otlp.BatchExporter | None = None
        self.processors: list[SpanProcessor] = []
        self.recorder: RecordingTracer | None = None  # set once something records


_state = _State()


def export_enabled() -> bool:
    return os.environ.get(EXPORT_ENV, "").strip().lower() in _TRUE


def sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def setup_tracing(service_name: str) -> None:
    """Set up this process's tracing (once; later calls do nothing): its resource
    (``service.name`` = ``OTEL_SERVICE_NAME`` or ``service_name``, plus
    ``OTEL_RESOURCE_ATTRIBUTES``), its sampler (``OTEL_TRACES_SAMPLER``) and, when
    ``OTEL_EXPORT_ENABLED=1``, its OTLP export (flushed at exit). Raises ``ValueError`` for a
    bad ``OTEL_*`` setting or when the exporter's transport is not installed."""
    state = _state
    if state.configured:
        return
    resource: dict[str, Any] = {
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "dynamo-py",
    }
    for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            resource[key.strip()] = value.strip()
    resource["service.name"] = os.environ.get("OTEL_SERVICE_NAME") or service_name
    state.resource = resource
    state.sampler = Sampler.from_env()
    state.disabled = sdk_disabled()
    if export_enabled() and not state.disabled:
        state.exporter = otlp.BatchExporter(otlp.Encoder(resource), otlp.transport())
        atexit.register(shutdown_tracing)
    state.configured = True
    _rebuild()


def add_span_processor(processor: SpanProcessor, service_name: str = "dynamo") -> None:
    """Send ended spans to an SDK ``processor`` too (as ``ReadableSpan`` s: an in-memory
    exporter in tests, any SDK exporter in process); recording goes on."""
    setup_tracing(service_name)
    _state.processors.append(processor)
    _rebuild()


def _rebuild() -> None:
    """The recording tracer for the current sinks (None while nothing records)."""
    state = _state
    exporter, processors = state.exporter, list(state.processors)
    if exporter is None and not processors:
        state.recorder = None
        return
    if not processors:
        assert exporter is not None
        sink = exporter.add  # the hot case: straight to the export queue
    else:

        def sink(span: RecordedSpan) -> None:
            if exporter is not None:
                exporter.add(span)
            readable = _readable(span)
            for processor in processors:
                processor.on_end(readable)

    state.recorder = RecordingTracer(sink, state.sampler)


def _readable(span: RecordedSpan) -> ReadableSpan:
    """The SDK's view of an ended span (for SDK processors)."""
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=Resource(_state.resource),
        attributes=span.attributes,
        events=[SdkEvent(e.name, e.attributes, e.time_ns) for e in span.events],
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_ns,
        end_time=span.end_ns,
        instrumentation_scope=InstrumentationScope("dynamo"),
    )


def recording() -> bool:
    """Whether spans go anywhere (an exporter or an added processor): per-chunk work is done
    only then."""
    return _state.recorder is not None


def shutdown_tracing() -> None:
    """Send what is queued and stop the exporter and processors (process exit)."""
    state = _state
    if state.exporter is not None:
        state.exporter.shutdown()
    for processor in state.processors:
        processor.shutdown()


def tracer() -> trace.Tracer:
    """The tracer every dynamo span comes from (tracing is set up on first use).

    While something records (:func:`recording`), spans are :class:`RecordedSpan` s. Otherwise
    they are local only: valid ids that continue the parent's trace (so log lines carry the
    trace id and the request carries a ``traceparent`` a downstream process that does export
    continues), without any bookkeeping. ``OTEL_SDK_DISABLED=true`` turns even those off."""
    return _tracer()


def _tracer() -> RecordingTracer | _LocalTracer | _NoopTracer:
    recorder = _state.recorder
    if recorder is not None:
        return recorder
    if not _state.configured:
        setup_tracing("dynamo")
        if _state.recorder is not None:
            return _state.recorder
    return _NOOP if _state.disabled else _LOCAL


def start_child(
    name: str,
    parent: SpanContext | None,
    *,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    attributes: Any = None,
    links: Any = None,
) -> Span:
    """``tracer().start_span`` under the span context ``parent`` (None: a new trace), for a
    caller that holds the parent's ids rather than a context (:func:`remote_parent`,
    :func:`context_of`): no ``Context`` is built to be read back."""
    return _tracer().start_child(name, parent, kind, attributes, links)


def context_of(span: Span) -> SpanContext | None:
    """``span``'s span context, or None if it is not valid (a disabled tracer's span)."""
    ctx = span.get_span_context()
    return ctx if ctx.is_valid else None


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
        return self.start_child(name, parent_of(context))

    def start_child(
        self,
        name: str,
        parent: SpanContext | None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
    ) -> Span:
        """A local span under the span context ``parent`` (None: a new trace)."""
        if parent is not None:  # the tuple (trace_id, span_id, is_remote, flags, ...)
            trace_id, flags = parent[0], parent[3]
        else:
            trace_id, flags = _random.getrandbits(128) or 1, SAMPLED
        span_id = _random.getrandbits(64) or 1
        return NonRecordingSpan(
            new_span_context((trace_id, span_id, False, flags, DEFAULT_TRACE_STATE, True))
        )

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
    ) -> SpanScope:
        # A local span records nothing: no exception to record, nothing to end.
        return SpanScope(self.start_child(name, parent_of(context)), end_on_exit=False)


class _NoopTracer(trace.NoOpTracer):
    """``OTEL_SDK_DISABLED=true``: the API's no-op tracer, with :meth:`start_child`."""

    def start_child(
        self,
        name: str,
        parent: SpanContext | None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
    ) -> Span:
        return INVALID_SPAN


_random = random.Random()
_LOCAL = _LocalTracer()
_NOOP = _NoopTracer()


# -- context across processes ----------------------------------------------------------------
def context_from_headers(headers: Mapping[str, str]) -> Context:
    """The parent context of an incoming HTTP request (its W3C ``traceparent``, if any)."""
    return _propagator.extract(headers)


def traceparent(span: Span | None = None) -> str | None:
    """The W3C ``traceparent`` value naming ``span`` (default: the current span), or None."""
    ctx = parent_of(None) if span is None else context_of(span)
    if ctx is None:
        return None
    # the tuple (trace_id, span_id, is_remote, flags, ...): see span_context.py
    return f"00-{ctx[0]:032x}-{ctx[1]:016x}-{ctx[3]:02x}"


_OWN_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
"""A version-00 ``traceparent`` exactly as :func:`traceparent` writes it."""


def parent_context(value: str | None) -> Context | None:
    """The context a ``traceparent`` value names (None: start a new trace).

    Every request a worker serves carries one: the form :func:`traceparent` writes is parsed
    here directly (a third of the propagator's cost, on each request's path to its first
    token); anything else goes through the W3C propagator, which applies every rule of the
    format."""
    if not value:
        return None
    own = _OWN_TRACEPARENT.fullmatch(value)
    if own is not None:
        trace_hex, span_hex, flags_hex = own.groups()
        trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
        if trace_id and span_id:
            return remote_context(trace_id, span_id, int(flags_hex, 16))
    return _propagator.extract({"traceparent": value})


def remote_parent(value: str | None) -> SpanContext | None:
    """The parent span context of the spans a request carrying the ``traceparent`` ``value``
    starts: what ``tracer().start_span(name, parent_context(value))`` continues, for
    :func:`start_child` (no value: the current span's, if any; an invalid one: None, a new
    trace)."""
    if not value:
        return parent_of(None)
    own = _OWN_TRACEPARENT.fullmatch(value)
    if own is not None:
        trace_hex, span_hex, flags_hex = own.groups()
        trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
        if trace_id and span_id:
            return span_context(trace_id, span_id, True, FLAGS[int(flags_hex, 16)])
    return parent_of(_propagator.extract({"traceparent": value}))


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
    token = attach(with_span(span))
    try:
        yield
    finally:
        detach(token)


in_span: Callable[[Span], Context] = with_span
"""A context whose current span is ``span`` (the parent of explicitly started children)."""


__all__ = [
    "add_span_processor",
    "context_from_headers",
    "context_of",
    "export_enabled",
    "in_span",
    "link_of",
    "links_of",
    "parent_context",
    "recording",
    "remote_parent",
    "sdk_disabled",
    "setup_tracing",
    "shutdown_tracing",
    "start_child",
    "traceparent",
    "tracer",
    "use",
    "with_predecessor",
    "with_traceparent",
]

"""Span contexts and the current span, made without the OpenTelemetry API's general paths.

Every dynamo span starts here (``tracing.py``'s local spans, ``recording.py``'s recorded ones),
a few per request in each process, so these run on the request path. The API's own way costs
several Python calls each: ``SpanContext(...)`` re-checks ids we generated valid (a Python
``__new__``), ``get_current_span`` goes through ``get_value`` and an ``isinstance`` against an
ABC (a Python ``__instancecheck__``), ``set_span_in_context`` through ``set_value`` and
``get_current``. These helpers build the same objects directly: a ``SpanContext`` is the
API's own tuple ``(trace_id, span_id, is_remote, trace_flags, trace_state, is_valid)``
(``tests/unit/observability/test_span_context.py`` checks the layout against the installed
API), the context the API's own ``Context`` holding the span under the API's own key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar, Token
from functools import partial

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, TraceFlags
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.trace.span import DEFAULT_TRACE_STATE, TraceState
from opentelemetry.trace.status import Status, StatusCode

log = logging.getLogger(__name__)

FLAGS = tuple(TraceFlags(i) for i in range(256))
"""Every ``TraceFlags`` value, made once (a W3C ``traceparent`` carries one byte)."""
SAMPLED = FLAGS[TraceFlags.SAMPLED]
UNSAMPLED = FLAGS[TraceFlags.DEFAULT]

_tuple_new = tuple.__new__


def span_context(
    trace_id: int,
    span_id: int,
    remote: bool,
    flags: TraceFlags,
    state: TraceState = DEFAULT_TRACE_STATE,
) -> SpanContext:
    """``SpanContext(trace_id, span_id, remote, flags, state)`` for ids the caller knows are
    valid (non-zero, 128 and 64 bits): the same tuple, without re-checking them."""
    return _tuple_new(SpanContext, (trace_id, span_id, remote, flags, state, True))


SpanContextTuple = tuple[int, int, bool, TraceFlags, TraceState, bool]
new_span_context: Callable[[SpanContextTuple], SpanContext] = partial(_tuple_new, SpanContext)
""":func:`span_context` from its tuple ``(trace_id, span_id, remote, flags, state, True)``:
a C call, no Python frame (the tracers' hot paths)."""


def _runtime_var() -> ContextVar[Context] | None:
    """The runtime context's ``ContextVar`` when the runtime is the API's default
    (``contextvars_context``); None for another (``OTEL_PYTHON_CONTEXT``): the API's calls."""
    runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    if type(runtime) is ContextVarsRuntimeContext:
        return runtime._current_context
    return None


_var = _runtime_var()
current_context: Callable[[], Context] = _var.get if _var is not None else otel_context.get_current
attach: Callable[[Context], Token[Context]] = _var.set if _var is not None else otel_context.attach
"""``otel_context.attach``: ``context`` current until :func:`detach` of the token."""


def detach(token: Token[Context]) -> None:
    """``otel_context.detach``: the context before the matching :func:`attach` is current
    again (a token from another context, or one used already, is logged, as the API does,
    not raised)."""
    if _var is None:
        otel_context.detach(token)
        return
    try:
        _var.reset(token)
    except (ValueError, RuntimeError):  # another context's token, or a used one
        log.exception("Failed to detach context")


SPAN_TYPES: set[type] = {NonRecordingSpan}
"""Span classes :func:`parent_of` accepts without ``isinstance`` (``recording.py`` adds its
``RecordedSpan``); any other value is checked against the API's ``Span``."""


def parent_of(context: Context | None) -> SpanContext | None:
    """The valid span context of ``context``'s span (default: the current context's), or None:
    what ``trace.get_current_span(context).get_span_context()`` gives when it is valid."""
    span = (current_context() if context is None else context).get(_SPAN_KEY)
    if span is None:
        return None
    if type(span) not in SPAN_TYPES and not isinstance(span, Span):
        return None  # not a span: the API reads it as no span
    ctx: SpanContext = span.get_span_context()  # type: ignore[attr-defined]  # a Span
    return ctx if ctx[5] else None  # is_valid


def with_span(span: Span, context: Context | None = None) -> Context:
    """``trace.set_span_in_context(span, context)``: a copy of ``context`` (default: the
    current one) with ``span`` as its current span."""
    values = (current_context() if context is None else context).copy()
    values[_SPAN_KEY] = span
    return Context(values)


def remote_context(trace_id: int, span_id: int, flags: int) -> Context:
    """The current context with a remote parent of valid ids as its span (what the W3C
    propagator's ``extract`` gives for a ``traceparent``, without a ``tracestate``)."""
    return with_span(NonRecordingSpan(span_context(trace_id, span_id, True, FLAGS[flags])))


class SpanScope:
    """``with``: ``span`` current for the block, as ``trace.use_span(span, end_on_exit,
    record_exception, set_status_on_exception)`` does (on an ``Exception`` a recording span
    gets the exception event and an error status; ended on exit if ``end_on_exit``), in
    three calls instead of a generator's frames and the API's ``attach``/``set_value`` layers
    (a request opens two: preprocess and route)."""

    __slots__ = ("span", "_token", "_end", "_record", "_status")

    def __init__(
        self,
        span: Span,
        end_on_exit: bool = True,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> None:
        self.span = span
        self._token: Token[Context] | None = None
        self._end = end_on_exit
        self._record = record_exception
        self._status = set_status_on_exception

    def __enter__(self) -> Span:
        self._token = attach(with_span(self.span))
        return self.span

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if self._token is not None:
            if _var is not None:
                try:
                    _var.reset(self._token)  # detach(), inline: a call less per span
                except (ValueError, RuntimeError):  # another context's token, or a used one
                    log.exception("Failed to detach context")
            else:
                otel_context.detach(self._token)
        span = self.span
        if isinstance(exc, Exception) and span.is_recording():
            if self._record:
                span.record_exception(exc)
            if self._status:
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        if self._end:
            span.end()


__all__ = [
    "SpanScope",
    "attach",
    "detach",
    "FLAGS",
    "SAMPLED",
    "SPAN_TYPES",
    "UNSAMPLED",
    "current_context",
    "new_span_context",
    "parent_of",
    "remote_context",
    "span_context",
    "with_span",
]

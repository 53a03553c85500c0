"""Recorded spans: the OpenTelemetry span API, implemented for what dynamo records.

The OpenTelemetry Python SDK's span costs ~35 us to create and end on the 2-core VM (sampler,
``BoundedAttributes`` with a lock and per-value validation, a ``ReadableSpan`` copy at the end),
and its OTLP encoder another ~60 us a span (a protobuf object per attribute, a JSON dump of the
resource per span to group them): 1.4x the CPU of a request with 5 spans (docs/performance.md,
"Tracing overhead"). A :class:`RecordedSpan` is a slotted record: ids, times, a plain attribute
dict, links, events and status; on ``end`` it goes to the tracer's sinks (the OTLP batch export
of ``otlp.py``, and any SDK ``SpanProcessor`` added in process, which gets the SDK's
``ReadableSpan``).

Sampling follows the standard ``OTEL_TRACES_SAMPLER`` (``parentbased_always_on`` by default,
``always_on``, ``always_off``, ``traceidratio``, ``parentbased_always_off``,
``parentbased_traceidratio``) and ``OTEL_TRACES_SAMPLER_ARG``; an unsampled span is a bare
``NonRecordingSpan`` that still carries ids (log lines and downstream processes keep the trace).
"""

from __future__ import annotations

import os
import random
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind
from opentelemetry.trace.span import DEFAULT_TRACE_STATE as DEFAULT_STATE
from opentelemetry.trace.status import Status, StatusCode

from dynamo.observability.span_context import (
    SAMPLED,
    SPAN_TYPES,
    UNSAMPLED,
    SpanScope,
    new_span_context,
    parent_of,
    span_context,
)

_random = random.Random()
UNSET_STATUS = Status(StatusCode.UNSET)
"""Every new span's status (shared: a span's status is replaced, never changed in place)."""


class Event:
    """A span event (``add_event``, ``record_exception``)."""

    __slots__ = ("name", "attributes", "time_ns")

    def __init__(self, name: str, attributes: dict[str, Any], time_ns: int) -> None:
        self.name = name
        self.attributes = attributes
        self.time_ns = time_ns


class RecordedSpan(Span):
    """A span that records (see the module docstring). Not thread-safe: one owner, like every
    dynamo span (the request's task)."""

    __slots__ = (
        "name",
        "context",
        "parent",
        "kind",
        "start_ns",
        "end_ns",
        "attributes",
        "links",
        "events",
        "status",
        "_sink",
    )

    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: Mapping[str, Any] | None,
        links: Sequence[Link] | None,
        start_ns: int,
        sink: Callable[[RecordedSpan], None],
    ) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes: dict[str, Any] = dict(attributes) if attributes else {}
        self.links = list(links) if links else []
        self.events: list[Event] = []
        self.status = UNSET_STATUS
        self._sink: Callable[[RecordedSpan], None] | None = sink

    # -- the span API --------------------------------------------------------------------
    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self._sink is not None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._sink is not None:
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._sink is not None:
            self.attributes.update(attributes)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self._sink is not None:
            at = time.time_ns() if timestamp is None else timestamp
            self.events.append(Event(name, dict(attributes) if attributes else {}, at))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._sink is not None and context.is_valid:
            self.links.append(Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self._sink is not None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._sink is None:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if self.status.status_code is StatusCode.OK:
            return  # OK is final (the API's rule)
        self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        trace_text = "".join(traceback.format_exception(exception))
        event = {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": trace_text,
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        sink = self._sink
        if sink is None:
            return  # ended already: the first end wins
        self._sink = None
        self.end_ns = time.time_ns() if end_time is None else end_time
        sink(self)


class RecordingTracer(trace.Tracer):
    """Starts :class:`RecordedSpan` s that end into ``sink`` (sampled by ``sampler``)."""

    def __init__(self, sink: Callable[[RecordedSpan], None], sampler: Sampler) -> None:
        self._sink = sink
        self._sampler = sampler
        self._parent_based = sampler.parent_based  # a child follows its parent's decision

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> Span:
        return self.start_child(name, parent_of(context), kind, attributes, links, start_time)

    def start_child(
        self,
        name: str,
        parent: SpanContext | None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
    ) -> Span:
        """:meth:`start_span` under the span context ``parent`` (None: a new trace), with no
        ``Context`` to build and read back."""
        if parent is not None:
            # a SpanContext is the tuple (trace_id, span_id, is_remote, flags, state, valid)
            trace_id, state = parent[0], parent[4]
            if self._parent_based:
                sampled = parent[3] & SAMPLED
            else:
                sampled = self._sampler.sample(parent, trace_id)
        else:
            trace_id, state = _random.getrandbits(128) or 1, DEFAULT_STATE
            sampled = self._sampler.sample(None, trace_id)
        span_id = _random.getrandbits(64) or 1
        if not sampled:
            return NonRecordingSpan(span_context(trace_id, span_id, False, UNSAMPLED, state))
        ctx = new_span_context((trace_id, span_id, False, SAMPLED, state, True))
        start = time.time_ns() if start_time is None else start_time
        return RecordedSpan(name, ctx, parent, kind, attributes, links, start, self._sink)

    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> SpanScope:
        span = self.start_child(name, parent_of(context), kind, attributes, links, start_time)
        return SpanScope(span, end_on_exit, record_exception, set_status_on_exception)


SPAN_TYPES.add(RecordedSpan)


class Sampler:
    """The standard samplers (``OTEL_TRACES_SAMPLER``), reduced to one decision per span."""

    _KINDS = (
        "always_on",
        "always_off",
        "traceidratio",
        "parentbased_always_on",
        "parentbased_always_off",
        "parentbased_traceidratio",
    )

    def __init__(self, kind: str = "parentbased_always_on", ratio: float = 1.0) -> None:
        if kind not in self._KINDS:
            raise ValueError(f"OTEL_TRACES_SAMPLER={kind!r} is not supported ({self._KINDS})")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={ratio} is not a ratio in [0, 1]")
        self.parent_based = kind.startswith("parentbased_")
        self.root = kind.removeprefix("parentbased_")
        # The SDK's rule: the trace id's low 64 bits under ratio * 2^64.
        self.bound = round(ratio * (1 << 64))

    @classmethod
    def from_env(cls) -> Sampler:
        kind = os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        arg = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            ratio = float(arg) if arg else 1.0
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a number") from None
        return cls(kind, ratio)

    def sample(self, parent: SpanContext | None, trace_id: int) -> bool:
        if self.parent_based and parent is not None:
            return parent.trace_flags.sampled
        if self.root == "always_on":
            return True
        if self.root == "always_off":
            return False
        return (trace_id & 0xFFFFFFFFFFFFFFFF) < self.bound

"""The fast span-context helpers build exactly what the OpenTelemetry API's own calls build
(they rely on its SpanContext's tuple layout and its current-span key: a new API version that
changes them fails here), and the spans' scope behaves as ``trace.use_span``."""

from __future__ import annotations

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, NonRecordingSpan, SpanContext, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from dynamo.observability import span_context as sc
from dynamo.observability.recording import RecordedSpan, RecordingTracer, Sampler

IDS = (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)


@pytest.mark.parametrize("remote", [True, False])
@pytest.mark.parametrize("flags", [0, 1, 3])
def test_span_context_is_the_apis(remote: bool, flags: int) -> None:
    state = TraceState([("k", "v")])
    ours = sc.span_context(*IDS, remote, sc.FLAGS[flags], state)
    theirs = SpanContext(*IDS, remote, TraceFlags(flags), state)
    assert ours == theirs and type(ours) is SpanContext
    assert (ours.trace_id, ours.span_id, ours.is_remote) == (*IDS, remote)
    assert ours.trace_flags == flags and ours.trace_state is state and ours.is_valid
    assert sc.span_context(*IDS, remote, sc.SAMPLED) == SpanContext(*IDS, remote, TraceFlags(1))


def test_the_current_span_as_the_api_reads_and_writes_it() -> None:
    span = NonRecordingSpan(sc.span_context(*IDS, True, sc.SAMPLED))
    assert sc.parent_of(None) is None  # nothing current
    ctx = sc.with_span(span)
    assert trace.get_current_span(ctx) is span
    assert sc.parent_of(ctx) is span.get_span_context()
    assert sc.parent_of(trace.set_span_in_context(span)) is span.get_span_context()
    assert sc.parent_of(trace.set_span_in_context(INVALID_SPAN)) is None
    assert sc.parent_of(otel_context.set_value("current-span", span)) is None  # another key
    token = sc.attach(ctx)
    try:
        assert otel_context.get_current() is ctx and sc.current_context() is ctx
        assert sc.parent_of(None) is span.get_span_context()
        assert trace.get_current_span() is span
    finally:
        sc.detach(token)
    assert trace.get_current_span() is INVALID_SPAN
    remote = sc.remote_context(*IDS, 1)
    assert trace.get_current_span(remote).get_span_context() == SpanContext(
        *IDS, True, TraceFlags(1)
    )


def test_a_value_that_is_not_a_span_reads_as_none() -> None:
    assert sc.parent_of(trace.set_span_in_context("nope")) is None  # type: ignore[arg-type]


def test_the_scope_records_an_exception_and_ends_the_span_as_use_span_does() -> None:
    ended: list[RecordedSpan] = []
    tracer = RecordingTracer(ended.append, Sampler())
    with pytest.raises(ValueError), tracer.start_as_current_span("work") as span:
        assert trace.get_current_span() is span
        raise ValueError("boom")
    assert trace.get_current_span() is INVALID_SPAN
    (done,) = ended
    assert done.status.status_code is StatusCode.ERROR
    assert done.status.description == "ValueError: boom"
    assert [e.name for e in done.events] == ["exception"]
    with tracer.start_as_current_span("quiet", record_exception=False, end_on_exit=False) as span:
        pass
    assert len(ended) == 1 and span.is_recording()  # not ended
    span.end()
    assert ended[-1].name == "quiet" and ended[-1].status.status_code is StatusCode.UNSET


def test_a_used_token_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    """As the API's ``detach``: a token used already must not fail the request's path."""
    token = sc.attach(sc.with_span(INVALID_SPAN))
    sc.detach(token)
    sc.detach(token)
    assert "Failed to detach context" in caplog.text

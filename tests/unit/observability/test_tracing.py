"""Tracing: the worker's spans (handle_payload, engine.generate and its attribute table), W3C
context in the request, links from a successor attempt to its predecessor."""

from __future__ import annotations

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from dynamo.backend.adapter import EngineAdapter, output_encoder
from dynamo.observability import otlp, tracing
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, StopConditions, TraceLink
from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument
from tests.fakes import CountingEngine
from tests.spans import SpanCapture

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def request(first: int = 1, **kw: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m", token_ids=[first, 2, 3], stop=StopConditions(max_tokens=5), **kw
    )


async def handle(adapter: EngineAdapter, req: PreprocessedRequest, ctx: Context) -> list[bytes]:
    return [b async for b in adapter.handle(output_encoder.encode(req), ctx)]


async def test_worker_spans_join_the_callers_trace_with_every_attribute(
    spans: SpanCapture,
) -> None:
    adapter = EngineAdapter(CountingEngine(), disagg_role="decode")
    bodies = await handle(adapter, request(traceparent=PARENT, request_id="r1"), Context())
    outs = [msgspec.msgpack.decode(b, type=LLMEngineOutput) for b in bodies]
    handle_span = spans.one("handle_payload")
    gen = spans.one("engine.generate")
    assert handle_span.kind is SpanKind.SERVER
    assert f"{handle_span.context.trace_id:032x}" == TRACE_ID
    assert handle_span.parent is not None and handle_span.parent.span_id == 0x00F067AA0BA902B7
    assert gen.parent is not None and gen.parent.span_id == handle_span.context.span_id
    assert gen.context.trace_id == handle_span.context.trace_id
    attrs = dict(gen.attributes or {})
    assert attrs["model"] == "m" and attrs["input_tokens"] == 3
    assert attrs["disagg_role"] == "decode"
    assert attrs["output_tokens"] == 5 and attrs["finish_reason"] == "length"
    assert attrs["cancelled"] is False
    assert attrs["ttft_ms"] >= 0
    for key in ("avg_itl_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms"):
        assert attrs[key] >= 0, key
    assert attrs["itl_p50_ms"] <= attrs["itl_p99_ms"] <= attrs["itl_max_ms"]
    assert "error_kind" not in attrs and gen.status.status_code is StatusCode.UNSET
    # The first chunk with tokens names the engine.generate span (for successors' links).
    stamped = [o.worker_trace_link for o in outs if o.worker_trace_link is not None]
    assert stamped == [tracing.link_of_context(gen.context)]


async def test_a_failed_request_marks_its_spans_as_errors(spans: SpanCapture) -> None:
    adapter = EngineAdapter(CountingEngine())
    with pytest.raises(InvalidArgument):
        await handle(adapter, request(666), Context())
    gen = spans.one("engine.generate")
    assert gen.status.status_code is StatusCode.ERROR
    assert dict(gen.attributes or {})["error_kind"] == "InvalidArgument"
    assert spans.one("handle_payload").status.status_code is StatusCode.ERROR
    await handle(adapter, request(667), Context())  # an error terminal from the engine
    errored = spans.named("engine.generate")[-1]
    assert errored.status.status_code is StatusCode.ERROR
    assert dict(errored.attributes or {})["finish_reason"] == "error"


async def test_a_cancelled_request_says_so(spans: SpanCapture) -> None:
    adapter = EngineAdapter(CountingEngine(delay=0.01))
    ctx = Context()
    ctx.stop_generating()
    await handle(adapter, request(), ctx)
    attrs = dict(spans.one("engine.generate").attributes or {})
    assert attrs["cancelled"] is True


async def test_a_successor_links_to_its_predecessor(spans: SpanCapture) -> None:
    prev = TraceLink(trace_id="ab" * 16, span_id="cd" * 8)
    base = request()
    succ = tracing.with_predecessor(base, prev)
    assert base.migration_link is None and succ.migration_link == prev
    assert tracing.with_predecessor(succ, None) is succ
    await handle(EngineAdapter(CountingEngine()), succ, Context())
    gen = spans.one("engine.generate")
    assert [
        (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in gen.links
    ] == [(prev.trace_id, prev.span_id)]
    attrs = dict(gen.attributes or {})
    assert attrs["migration_trace_id"] == prev.trace_id
    assert attrs["migration_span_id"] == prev.span_id
    # A malformed link from a peer is ignored rather than failing the request.
    assert tracing.links_of(request(migration_link=TraceLink(trace_id="zz", span_id="1"))) == []


def test_traceparent_round_trip(spans: SpanCapture) -> None:
    with tracing.tracer().start_as_current_span("outer") as span:
        req = tracing.with_traceparent(request())
    assert req.traceparent == tracing.traceparent(span)
    ctx = span.get_span_context()
    assert req.traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    assert ctx.trace_flags.sampled
    assert tracing.parent_context(None) is None
    assert tracing.with_traceparent(request()).traceparent is None  # no current span


@pytest.mark.parametrize(
    "value",
    [
        PARENT,
        f"00-{TRACE_ID}-00f067aa0ba902b7-00",  # not sampled
        f"00-{'0' * 32}-00f067aa0ba902b7-01",  # an all-zero trace id: invalid
        f"00-{TRACE_ID}-{'0' * 16}-01",  # an all-zero span id: invalid
        f"00-{TRACE_ID.upper()}-00F067AA0BA902B7-01",  # upper case: not W3C
        f"ff-{TRACE_ID}-00f067aa0ba902b7-01",  # a forbidden version
        f"01-{TRACE_ID}-00f067aa0ba902b7-01-future",  # a later version's extra field
        f"00-{TRACE_ID}-00f067aa0ba902b7-01-extra",
        "garbage",
    ],
)
def test_parent_context_reads_what_the_w3c_propagator_reads(value: str) -> None:
    """The fast path for our own ``traceparent`` agrees with the propagator on every value."""
    from opentelemetry import trace

    expected = trace.get_current_span(tracing._propagator.extract({"traceparent": value}))  # noqa: SLF001
    got = trace.get_current_span(tracing.parent_context(value))
    assert got.get_span_context() == expected.get_span_context()
    assert got.get_span_context().is_remote == expected.get_span_context().is_remote
    # the worker's way (start_child under remote_parent): the same parent, or None if invalid
    parent = tracing.remote_parent(value)
    want = expected.get_span_context()
    assert parent == (want if want.is_valid else None)
    assert parent is None or parent.is_remote


def test_start_child_continues_the_trace_a_traceparent_names(spans: SpanCapture) -> None:
    """The worker's spans: ``start_child`` under ``remote_parent`` is ``start_span`` under
    ``parent_context``, with no value the current span, and with none a new trace."""
    child = tracing.start_child("child", tracing.remote_parent(PARENT), attributes={"a": 1})
    child.end()
    via_context = tracing.tracer().start_span("ctx", tracing.parent_context(PARENT))
    via_context.end()
    got, want = spans.one("child"), spans.one("ctx")
    assert got.parent == want.parent and got.parent is not None and got.parent.is_remote
    assert got.context.trace_id == want.context.trace_id == int(TRACE_ID, 16)
    assert got.attributes == {"a": 1}
    with tracing.tracer().start_as_current_span("outer") as outer:
        inner = tracing.start_child("inner", tracing.remote_parent(None))
    assert inner.get_span_context().trace_id == outer.get_span_context().trace_id
    root = tracing.start_child("root", None)
    assert root.get_span_context().trace_id != outer.get_span_context().trace_id
    assert tracing.context_of(trace.INVALID_SPAN) is None


def test_unknown_otlp_protocol_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="carrier-pigeon"):
        otlp.transport()


def test_local_spans_carry_ids_without_recording() -> None:
    local = tracing._LOCAL  # noqa: SLF001 - what tracer() returns while nothing records
    root = local.start_span("root")
    ctx = root.get_span_context()
    assert ctx.is_valid and ctx.trace_flags.sampled and not root.is_recording()
    child = local.start_span("child", context=tracing.parent_context(tracing.traceparent(root)))
    assert child.get_span_context().trace_id == ctx.trace_id
    assert child.get_span_context().span_id != ctx.span_id
    with local.start_as_current_span("current") as current:
        assert tracing.traceparent() == tracing.traceparent(current)
        nested = local.start_span("nested")
    assert nested.get_span_context().trace_id == current.get_span_context().trace_id
    assert tracing.traceparent() is None  # restored


def test_a_local_span_scope_restores_the_context_on_error() -> None:
    local = tracing._LOCAL  # noqa: SLF001
    with pytest.raises(RuntimeError), local.start_as_current_span("failing") as span:
        assert tracing.traceparent() == tracing.traceparent(span)
        raise RuntimeError("boom")
    assert tracing.traceparent() is None

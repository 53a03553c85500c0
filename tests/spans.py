"""Span capture for tests: an in-memory processor on the process's tracer provider, collecting
only while a test holds it (the ``spans`` fixture in ``tests/conftest.py``)."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from dynamo.observability import tracing


class SpanCapture(SpanProcessor):
    """Ended spans, kept while :attr:`active`."""

    def __init__(self) -> None:
        self.active = False
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        if self.active:
            self.spans.append(span)

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        found = self.named(name)
        assert len(found) == 1, (name, [s.name for s in self.spans])
        return found[0]


_capture: SpanCapture | None = None


def span_capture() -> SpanCapture:
    """The process's capture (installed on first use: recording goes on for the session)."""
    global _capture
    if _capture is None:
        _capture = SpanCapture()
        tracing.add_span_processor(_capture)
    return _capture

"""Traces and JSONL logs across real processes: a frontend and a mocker export their spans over
OTLP/HTTP to a receiver the test runs, and their JSON log lines carry the request's trace id."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.e2e.frontend.frontend_stack import Stack, request, wait_instances
from tests.otlp_receiver import OtlpReceiver

CLIENT_TRACE = "5b8efff798038103d269b633813fc60c"
CLIENT_SPAN = "eee19b7ec3c1b174"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


def test_one_trace_across_processes_reaches_the_otlp_receiver(receiver: OtlpReceiver) -> None:
    env = {
        "OTEL_EXPORT_ENABLED": "1",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "DYN_LOGGING_JSONL": "1",
        "DYN_LOG": "info,dynamo.frontend.inflight=debug,dynamo.backend.adapter=debug",
    }
    stack = Stack()
    try:
        frontend = stack.frontend(**env)
        mocker = stack.mocker("demo", "--speedup-ratio", "0", **env)
        wait_instances(stack.port, 1)
        status, headers, body = request(
            stack.port,
            "POST",
            "/v1/chat/completions",
            {
                "model": "demo",
                "messages": [{"role": "user", "content": "across processes"}],
                "max_tokens": 4,
                "stream": True,
            },
            headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        )
        assert status == 200 and b"[DONE]" in body
        names = {"http-request", "preprocess", "route", "handle_payload", "engine.generate"}
        spans = {s.name: s for s in receiver.wait_for(CLIENT_TRACE, names)}
        root = spans["http-request"]
        assert root.service == "dynamo-frontend" and root.parent_span_id == CLIENT_SPAN
        for name in ("preprocess", "route", "handle_payload"):
            assert spans[name].parent_span_id == root.span_id, name
        gen = spans["engine.generate"]
        assert gen.service == "dynamo-mocker"
        assert gen.parent_span_id == spans["handle_payload"].span_id
        assert gen.attributes["output_tokens"] == 4 and gen.attributes["model"] == "demo"
        assert not any(s.error for s in spans.values())
        # JSONL logs: every line of both processes parses; the request's lines carry its trace.
        for child, message in ((frontend, "request "), (mocker, "engine.generate done")):
            child.wait_for(message)
            records = [json.loads(line) for line in child.lines if line.startswith("{")]
            assert records and all(
                {"time", "level", "target", "message"} <= r.keys() for r in records
            )
            mine = [r for r in records if r["message"].startswith(message)]
            assert mine and all(r["trace_id"] == CLIENT_TRACE for r in mine), mine
    finally:
        stack.close()

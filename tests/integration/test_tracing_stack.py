"""One streamed request through the whole stack in one process: one trace holding the frontend's
request, preprocessing and routing spans and the worker's handling and engine.generate spans."""

from __future__ import annotations

import asyncio
import json

import pytest
from opentelemetry.trace import StatusCode

from dynamo.protocol.model_card import WorkerRole
from tests.integration.conftest import Stack
from tests.spans import SpanCapture

pytestmark = pytest.mark.integration

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


async def test_one_trace_from_http_to_engine(stack: Stack, spans: SpanCapture) -> None:
    await stack.add_worker("--speedup-ratio", "0", "--block-size", "16")
    client = await stack.start_frontend(router_mode="kv")
    await stack.wait_for_model()
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "demo",
            "messages": [{"role": "user", "content": "trace me " * 20}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
            "x-request-id": "trace-req-1",
        },
    ) as r:
        assert r.status_code == 200
        body = (await r.aread()).decode()
    assert "[DONE]" in body
    root = spans.one("http-request")
    pre, route = spans.one("preprocess"), spans.one("route")
    handle, gen = spans.one("handle_payload"), spans.one("engine.generate")
    # One trace, continuing the client's.
    assert {s.context.trace_id for s in (root, pre, route, handle, gen)} == {int(CLIENT_TRACE, 16)}
    assert root.parent is not None and root.parent.span_id == int(CLIENT_SPAN, 16)
    for child in (pre, route, handle):
        assert child.parent is not None and child.parent.span_id == root.context.span_id
    assert gen.parent is not None and gen.parent.span_id == handle.context.span_id
    r_attrs = dict(root.attributes or {})
    assert r_attrs["x_request_id"] == "trace-req-1" and r_attrs["model"] == "demo"
    assert r_attrs["status"] == "success" and r_attrs["request_type"] == "stream"
    route_attrs = dict(route.attributes or {})
    assert route_attrs["router_mode"] == "kv"
    worker = stack.workers[0].worker_ids[0]
    assert route_attrs["worker_id"] == f"{worker:x}"
    assert route_attrs["overlap_blocks"] == 0 and "cost" in route_attrs
    g = dict(gen.attributes or {})
    assert g["model"] == "demo" and g["disagg_role"] == "agg"
    assert g["input_tokens"] == dict(pre.attributes or {})["input_tokens"]
    assert g["output_tokens"] == 6 and g["finish_reason"] == "length"
    assert g["cancelled"] is False and g["ttft_ms"] >= 0
    assert all(s.status.status_code is not StatusCode.ERROR for s in spans.spans)


async def test_an_unknown_model_fails_its_request_span(stack: Stack, spans: SpanCapture) -> None:
    client = await stack.start_frontend()
    r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404
    root = spans.one("http-request")
    assert root.status.status_code is StatusCode.ERROR
    assert dict(root.attributes or {})["error_type"] == "not_found"


async def test_a_decode_span_links_to_its_prefill_span(stack: Stack, spans: SpanCapture) -> None:
    mocker = ("--speedup-ratio", "0", "--block-size", "16", "--num-gpu-blocks-override", "1024")
    await stack.add_worker(*mocker, "--disaggregation-mode", "prefill")
    await stack.add_worker(*mocker, "--disaggregation-mode", "decode")
    client = await stack.start_frontend()
    await stack.wait_for_model()
    assert stack.frontend is not None
    async with asyncio.timeout(10):
        while not stack.frontend.registry.get("demo").live_instance_ids(WorkerRole.PREFILL):
            await asyncio.sleep(0.02)
    prompt = " ".join(f"linked word{i}" for i in range(400))  # long: prefilled remotely
    r = await client.post(
        "/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 4}
    )
    assert r.status_code == 200, r.text
    gens = {dict(s.attributes or {})["disagg_role"]: s for s in spans.named("engine.generate")}
    prefill, decode = gens["prefill"], gens["decode"]
    assert prefill.context.trace_id == decode.context.trace_id
    assert [(lk.context.trace_id, lk.context.span_id) for lk in decode.links] == [
        (prefill.context.trace_id, prefill.context.span_id)
    ]
    attrs = dict(decode.attributes or {})
    assert attrs["migration_span_id"] == f"{prefill.context.span_id:016x}"
    assert len(spans.named("route")) == 2  # the decode worker's and the prefill worker's


async def test_a_migrated_attempt_links_to_the_previous_one(
    stack: Stack, spans: SpanCapture
) -> None:
    # Speedup 1 (~6 ms a token): the stream is still running when its worker shuts down, and a
    # zero grace period ends it mid-stream, so the frontend migrates it to the other worker.
    mocker = ("--speedup-ratio", "1", "--block-size", "16", "--graceful-shutdown-timeout", "0")
    first = await stack.add_worker(*mocker)
    second = await stack.add_worker(*mocker)
    client = await stack.start_frontend(migration_limit=2)
    await stack.wait_for_model(instances=2)
    max_tokens = 200
    text, usage, shut = "", None, False
    async with client.stream(
        "POST",
        "/v1/completions",
        json={
            "model": "demo",
            "prompt": "migrate me " * 10,
            "max_tokens": max_tokens,
            "seed": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            text += "".join(c.get("text") or "" for c in chunk.get("choices", []))
            if text and not shut:  # mid-stream: stop the worker the request was routed to
                routed = int(dict(spans.one("route").attributes or {})["worker_id"], 16)
                next(w for w in (first, second) if routed in w.worker_ids).request_shutdown()
                shut = True
    assert usage is not None and usage["completion_tokens"] == max_tokens
    gens = spans.named("engine.generate")
    assert len(gens) == 2, [s.name for s in spans.spans]
    before, after = sorted(gens, key=lambda s: s.start_time or 0)
    assert {before.context.trace_id, after.context.trace_id} == {int(CLIENT_TRACE, 16)}
    assert before.context.span_id != after.context.span_id
    assert not before.links
    assert [(lk.context.trace_id, lk.context.span_id) for lk in after.links] == [
        (before.context.trace_id, before.context.span_id)
    ]
    attrs = dict(after.attributes or {})
    assert attrs["migration_trace_id"] == f"{before.context.trace_id:032x}"
    assert attrs["migration_span_id"] == f"{before.context.span_id:016x}"
    # The continuation's prompt holds what the first attempt generated.
    assert attrs["input_tokens"] > dict(before.attributes or {})["input_tokens"]
    assert len(spans.named("route")) == 2  # one routing decision per attempt

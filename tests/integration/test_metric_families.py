"""The FACTS §10.1 families added by issue 17, through the whole stack in one process: each
request moves its counters exactly once, gauges return to zero, per-worker gauges name the
worker that served."""

from __future__ import annotations

import pytest

from tests.integration.conftest import Stack

pytestmark = pytest.mark.integration

P = "dynamo_frontend"


async def test_new_frontend_and_worker_families(stack: Stack) -> None:
    worker = await stack.add_worker("--speedup-ratio", "0", "--block-size", "16")
    client = await stack.start_frontend(router_mode="kv")
    await stack.wait_for_model()
    assert stack.frontend is not None
    reg = stack.frontend.metrics.registry

    def value(name: str, **labels: str) -> float:
        got = reg.get_sample_value(name, labels)
        return 0.0 if got is None else got

    body = {"model": "demo", "messages": [{"role": "user", "content": "count me " * 30}]}
    for stream in (False, True):
        r = await client.post(
            "/v1/chat/completions", json={**body, "max_tokens": 5, "stream": stream}
        )
        assert r.status_code == 200
    r = await client.post("/v1/chat/completions", json={**body, "model": "nope"})
    assert r.status_code == 404

    ep = {"model": "demo", "endpoint": "chat_completions"}
    assert value(f"{P}_requests_started_total", **ep, request_type="unary") == 1
    assert value(f"{P}_requests_started_total", **ep, request_type="stream") == 1
    assert (
        value(f"{P}_requests_total", **ep, request_type="stream", status="success", error_type="")
        == 1
    )
    failed = {"endpoint": "chat_completions", "request_type": "unary", "error_type": "not_found"}
    assert value(f"{P}_failures_total", model="unknown", **failed) == 1
    assert value(f"{P}_queued_requests", model="demo") == 0
    for stage, phase in (("preprocess", ""), ("route", ""), ("dispatch", "aggregated")):
        assert value(f"{P}_stage_requests", stage=stage, phase=phase) == 0
        assert value(f"{P}_stage_duration_seconds_count", stage=stage) == 2, stage
    assert value(f"{P}_tokenizer_latency_ms_count", model="demo") == 2
    assert value(f"{P}_kv_hit_rate_count", model="demo") == 2
    wid = f"{worker.worker_ids[0]:x}"
    key = {"worker_id": wid, "dp_rank": "0", "worker_type": "agg"}
    assert value(f"{P}_worker_last_time_to_first_token_seconds", **key) > 0
    assert value(f"{P}_worker_last_input_sequence_tokens", **key) > 30
    # The KV router's view of the worker: present, and idle again.
    assert reg.get_sample_value(f"{P}_worker_active_decode_blocks", key) == 0
    assert reg.get_sample_value(f"{P}_worker_active_prefill_tokens", key) == 0
    # The worker counts the bytes it received and sent.
    wreg = worker.metrics_registry
    names = {
        "dynamo_namespace": "dynamo",
        "dynamo_component": worker.config.endpoint_id().component,
        "dynamo_endpoint": "generate",
    }
    assert (wreg.get_sample_value("dynamo_component_request_bytes_total", names) or 0) > 100
    assert (wreg.get_sample_value("dynamo_component_response_bytes_total", names) or 0) > 10

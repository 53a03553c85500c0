"""With a timed mocker, every token is its own chunk: TTFT and ITL are observed per token."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from tests.integration.conftest import Stack

pytestmark = pytest.mark.integration


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


async def test_itl_and_ttft_observed_per_token(stack: Stack) -> None:
    # passes of ~23 ms: real gaps, each longer than a loaded machine needs to carry a token
    # through the stack (at 2x, passes of ~3 ms could leave two tokens to one chunk)
    await stack.add_worker("--speedup-ratio", "0.25")
    client = await stack.start_frontend()
    await stack.wait_for_model()
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 10,
        "stream": True,
        "nvext": {"ignore_eos": True},
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    assert len(events) >= 1 + 8, "role chunk plus (nearly) one chunk per token"
    assert stack.frontend is not None
    text = generate_latest(stack.frontend.metrics.registry).decode()
    assert metric(text, "dynamo_frontend_time_to_first_token_seconds_count") == 1
    assert metric(text, "dynamo_frontend_inter_token_latency_seconds_count") >= 7
    assert metric(text, "dynamo_frontend_output_tokens_total") == 10

"""The frontend with ``--tokenize-in process``: concurrent chat and completion requests, streamed
and not, are tokenized in the child process with the ids a request alone gets on the event
loop; a killed child costs no request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import httpx
import pytest

from dynamo.preprocess.encode_process import EncodeProcess
from tests.integration.conftest import Stack

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def body(path: str, i: int, stream: bool) -> dict[str, Any]:
    text = f"request {i}: the quick brown fox jumps over the lazy dog, café 你好 🦄"
    fields: dict[str, Any] = {"model": "demo", "max_tokens": 4, "stream": stream}
    if stream:
        fields["stream_options"] = {"include_usage": True}
    if path == CHAT:
        return {**fields, "messages": [{"role": "user", "content": text}]}
    return {**fields, "prompt": [text, text + " again"] if i % 2 else text}


async def prompt_tokens(client: httpx.AsyncClient, path: str, i: int, stream: bool) -> int:
    """The request's prompt tokens from its usage (streamed: the usage chunk)."""
    if not stream:
        r = await client.post(path, json=body(path, i, stream))
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])
    async with client.stream("POST", path, json=body(path, i, stream)) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    usage = [json.loads(line[6:]).get("usage") for line in lines[:-1]]
    return int([u for u in usage if u][-1]["prompt_tokens"])


CASES = [(path, i, i % 3 != 0) for path in (CHAT, COMPLETIONS) for i in range(6)]


async def test_concurrent_requests_are_tokenized_in_the_child_with_the_same_ids(
    stack: Stack,
) -> None:
    await stack.add_worker("--speedup-ratio", "0.25")
    client = await stack.start_frontend(tokenize_in="process")
    await stack.wait_for_model()
    assert stack.frontend is not None
    encoder = stack.frontend.generate.offload.encoder
    assert isinstance(encoder, EncodeProcess)
    alone = [await prompt_tokens(client, *case) for case in CASES]  # inline, one at a time
    assert encoder.jobs == 0

    # a long stream keeps another request in flight: every request below takes the batched path
    long = {**body(CHAT, 99, True), "max_tokens": 4000, "nvext": {"ignore_eos": True}}
    async with client.stream("POST", CHAT, json=long) as held:
        assert held.status_code == 200
        lines = held.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        together = await asyncio.gather(*(prompt_tokens(client, *case) for case in CASES))
        assert together == alone
        assert encoder.jobs == len(CASES) and encoder.fallback_jobs == 0

        child = encoder.pid
        assert child is not None
        os.kill(child, signal.SIGKILL)
        after = await asyncio.gather(*(prompt_tokens(client, *case) for case in CASES))
        assert after == alone
        # a batch sent to the dead child was encoded in the frontend, or the death was seen
        # first and a new child answered: either way no request failed
        assert encoder.fallback_jobs >= 1 or encoder.starts == 2

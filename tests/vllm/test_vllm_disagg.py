"""Disaggregated serving on vLLM workers, real processes on loopback: a frontend that prefills
every prompt remotely (``--max-local-prefill-length 0``), one ``dynamo.vllm`` prefill worker and
one decode worker. The prompt's KV moves from the prefill worker's vLLM cache to the decode
worker's through our KV connector (vLLM's connector API, our transfer agents); greedy output
equals the aggregated output (transformers' ``generate``, which the aggregated vLLM engine is
tested to match), for prompts shorter than a block (nothing to move), of whole blocks, and
sharing a prefix the decode worker already holds (only the rest moves). A handoff whose KV
cannot be pulled fails its request with ``KVTransferFailed`` (vLLM's ``fail`` policy), and the
decode worker serves on."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.context import Context
from dynamo.runtime.errors import KVTransferFailed
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime
from tests.e2e.frontend.frontend_stack import Stack, request, wait_http
from tests.e2e.processes import Child, free_port
from tests.tiny_models import build, hf_greedy
from tests.vllm.test_vllm_http import START_TIMEOUT, VLLM_ENV, worker_args

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def disagg_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path, Child]]:
    model = build("llama_hd64", tmp_path_factory.getbasetemp())
    stack = Stack()
    try:
        prefill = stack.spawn([*worker_args(model), "--disaggregation-mode", "prefill"], **VLLM_ENV)
        decode = stack.spawn([*worker_args(model), "--disaggregation-mode", "decode"], **VLLM_ENV)
        for w in (prefill, decode):
            w.wait_for("serving model", timeout=START_TIMEOUT)
        stack.frontend("--router-mode", "kv", "--max-local-prefill-length", "0")
        wait_http(stack.port, "/v1/models")
        yield stack, model, decode
    finally:
        stack.close()


def generate(port: int, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    body |= {"ignore_eos": True, "nvext": {"annotations": ["token_ids"]}}
    status, _, raw = request(port, "POST", "/v1/completions", body, timeout=120)
    assert status == 200, raw
    out: dict[str, Any] = json.loads(raw)
    return out


def metric(port: int, name: str) -> float:
    _, _, body = request(port, "GET", "/metrics", timeout=10)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith(name + "{")
    )


def test_vllm_disagg_greedy_output_equals_aggregated(
    disagg_stack: tuple[Stack, Path, Child],
) -> None:
    stack, model, decode = disagg_stack
    base = [(11 * i) % 380 + 5 for i in range(200)]
    prompts = [
        base[:20],  # under one block: nothing moves, the handoff still ends
        base[:64],  # two whole blocks: the last token's block is computed on the decode side
        base[:150],  # four blocks move, the tail is computed
        base[:170],  # the same prefix: the decode worker holds it, only the fifth block moves
        [(7 * i + 3) % 380 + 5 for i in range(97)],
    ]
    for prompt in prompts:
        body = generate(stack.port, prompt)
        assert body["nvext"]["token_ids"] == hf_greedy(model, prompt, MAX_TOKENS), len(prompt)
        assert body["choices"][0]["finish_reason"] == "length"
    assert metric(stack.port, "dynamo_frontend_disagg_prefills_total") == len(prompts)
    port = status_port(decode)
    assert metric(port, "dynamo_component_disagg_handoffs_total") == len(prompts)
    # the prompts' blocks came over the transfer agents
    assert metric(port, "dynamo_component_kv_transfer_bytes_total") > 0


def status_port(worker: Child) -> int:
    line = worker.wait_for("status server listening on")
    return int(line.rsplit(":", 1)[1].split()[0])


async def test_an_unpullable_handoff_fails_with_kv_transfer_failed(
    disagg_stack: tuple[Stack, Path, Child],
) -> None:
    stack, model, decode = disagg_stack
    runtime = DistributedRuntime(
        RuntimeConfig(discovery_backend="file", discovery_dir=stack.discovery_dir)
    )
    await runtime.start()
    try:
        client = await runtime.client(EndpointId("dynamo", "backend", "generate"))
        await client.wait_for_instances(1, timeout=60)
        (iid,) = client.instance_ids()
        prompt = [(5 * i) % 380 + 5 for i in range(100)]
        handoff = DisaggregatedParams(
            prefill_worker_id=0xDEAD,
            num_prompt_tokens=len(prompt),
            engine_specific={  # a prefill agent that is gone: nothing listens there
                "remote_host": "127.0.0.1",
                "remote_port": free_port(),
                "remote_handle": "gone",
                "remote_block_ids": [1, 2, 3, 4],
            },
        )
        body = msgspec.msgpack.encode(
            PreprocessedRequest(
                model="tiny",
                token_ids=prompt,
                sampling=SamplingOptions(temperature=0.0),
                stop=StopConditions(max_tokens=4, ignore_eos=True),
                prefill_result=handoff,
            )
        )
        dec = msgspec.msgpack.Decoder(LLMEngineOutput)
        with pytest.raises(KVTransferFailed):
            async for raw in client.stream(body, Context(), instance_id=iid):
                dec.decode(raw)
    finally:
        await runtime.shutdown()
    # the failed request holds nothing; the worker serves on
    port = status_port(decode)
    deadline = time.monotonic() + 60
    while metric(port, "dynamo_component_num_requests_running") != 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    again = generate(stack.port, [9, 8, 7])
    assert again["nvext"]["token_ids"] == hf_greedy(model, [9, 8, 7], MAX_TOKENS)

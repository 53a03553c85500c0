"""The PyTorch engine through the whole HTTP stack (frontend, router, request plane, worker):
greedy output is token-identical to transformers' ``generate`` on the same tiny random model,
alone, batched, with chunked prefill and after a prefix-cache hit; KV routing across two
engine workers sends a repeated prefix to the worker that holds it."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")

from dynamo.backend.serve_engine import ServeOptions  # noqa: E402
from dynamo.backend.worker import Worker  # noqa: E402
from dynamo.pytorch.__main__ import build_worker  # noqa: E402
from dynamo.pytorch.config import TorchEngineConfig  # noqa: E402
from dynamo.router.hashing import local_block_hashes  # noqa: E402
from dynamo.router.kv_router import KVRouter  # noqa: E402
from tests.integration.conftest import RUNTIME, Stack  # noqa: E402
from tests.tiny_models import TEST_DEVICE, build, hf_greedy  # noqa: E402

pytestmark = pytest.mark.integration

BS = 16


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(request.param, tmp_path_factory.getbasetemp())


async def add_worker(
    stack: Stack, model: Path, *, system_port: int | None = None, **overrides: Any
) -> Worker:
    settings: dict[str, Any] = {
        "model_path": str(model),
        "model_name": "tiny",
        "block_size": BS,
        "num_gpu_blocks_override": 256,
        "max_num_batched_tokens": 48,  # prompts above this are chunked
        "device": TEST_DEVICE,
    }
    settings.update(overrides)
    worker = build_worker(
        TorchEngineConfig(**settings),
        RUNTIME,
        hub=stack.hub,
        install_signal_handlers=False,
        options=ServeOptions(system_host="127.0.0.1", system_port=system_port),
    )
    stack.workers.append(worker)
    stack.tasks.append(asyncio.create_task(worker.run(), name="test-pytorch-worker"))
    await asyncio.wait_for(worker.ready.wait(), 30)
    return worker


async def complete(stack: Stack, prompt: list[int], max_tokens: int, **extra: Any) -> dict:
    assert stack.client is not None
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "nvext": {"annotations": ["token_ids"], "extra_fields": ["worker_id"]},
        **extra,
    }
    r = await stack.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def tokens_of(body: dict) -> list[int]:
    return list(body["nvext"]["token_ids"])


async def test_greedy_matches_transformers(stack: Stack, model_dir: Path) -> None:
    worker = await add_worker(stack, model_dir, system_port=0)
    await stack.start_frontend()
    await stack.wait_for_model("tiny")
    rng = random.Random(1)
    # One request alone (70 tokens: two prefill chunks of at most 48).
    single = [rng.randrange(5, 390) for _ in range(70)]
    body = await complete(stack, single, 8)
    assert tokens_of(body) == hf_greedy(model_dir, single, 8)
    # 16 concurrent requests of different lengths, batched together.
    prompts = [[rng.randrange(5, 390) for _ in range(rng.randrange(1, 90))] for _ in range(16)]
    bodies = await asyncio.gather(*(complete(stack, p, 8) for p in prompts))
    for p, b in zip(prompts, bodies, strict=True):
        assert tokens_of(b) == hf_greedy(model_dir, p, 8), len(p)
        assert b["usage"]["completion_tokens"] == 8
    # A prefix-cache hit: the single prompt's first blocks are reused.
    follow = single[:50] + [rng.randrange(5, 390) for _ in range(10)]
    body = await complete(stack, follow, 8)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    assert tokens_of(body) == hf_greedy(model_dir, follow, 8)
    # The engine's metrics on the worker's status server: the 16 requests ran batched.
    assert worker.status is not None
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{worker.status.port}/metrics")).text
    metrics = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dynamo_component_")
    }
    assert metrics["dynamo_component_engine_max_batch_requests"] >= 2  # batched (how many: load)
    assert 0 < metrics["dynamo_component_kv_cache_hit_rate"] < 1
    assert metrics["dynamo_component_engine_output_tokens_total"] == 18 * 8
    assert metrics["dynamo_component_total_blocks"] == 256
    assert metrics["dynamo_component_num_requests_running"] == 0
    # each family once (the engine gauges are the worker's, not also the engine collector's)
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps))


async def test_chat_with_seeded_choices(stack: Stack, tiny_dir: Path) -> None:
    await add_worker(stack, tiny_dir)
    await stack.start_frontend()
    await stack.wait_for_model("tiny")
    assert stack.client is not None
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 6,
        "n": 2,
        "seed": 11,
        "temperature": 1.0,
    }
    first = await stack.client.post("/v1/chat/completions", json=body)
    again = await stack.client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    a, b = first.json(), again.json()
    assert [c["message"]["content"] for c in a["choices"]] == [
        c["message"]["content"] for c in b["choices"]
    ]
    assert len(a["choices"]) == 2
    assert a["choices"][0]["message"]["content"] != a["choices"][1]["message"]["content"]
    assert a["usage"]["completion_tokens"] == 12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.getbasetemp())


async def test_kv_routing_sends_a_repeated_prefix_to_its_holder(
    stack: Stack, tiny_dir: Path
) -> None:
    for _ in range(2):
        await add_worker(stack, tiny_dir)
    await stack.start_frontend(router_mode="kv")
    await stack.wait_for_model("tiny", instances=2)
    assert stack.frontend is not None
    router = stack.frontend.registry.get("tiny").router
    assert isinstance(router, KVRouter) and router.indexer is not None
    rng = random.Random(5)
    for group in range(2):
        prefix = [rng.randrange(5, 390) for _ in range(6 * BS)]
        first = await complete(stack, prefix + [1, 2], 2)
        owner = first["nvext"]["worker_id"]["decode_worker_id"]
        # the first request's KV events reach the router (from the step thread, through the
        # event plane: its answer can come first), waited for, not assumed done in 50 ms
        local = local_block_hashes(prefix, BS)
        async with asyncio.timeout(30):
            while router.indexer.find_matches(local).get((owner, 0), 0) < len(local):
                await asyncio.sleep(0.01)
        for unique in range(3):
            body = await complete(stack, prefix + [3 + unique, 4], 2)
            assert body["nvext"]["worker_id"]["decode_worker_id"] == owner, group
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BS


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", 'say "hi"']},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "active", "kind", "tags"],
    "additionalProperties": False,
}


async def test_guided_json_always_parses_and_validates(stack: Stack, tiny_dir: Path) -> None:
    """response_format json_schema over 50 seeded samples (random weights: every output is
    the grammar's doing); nvext guided choice and regex on completions; a bad grammar is a
    400 naming the problem."""
    jsonschema = pytest.importorskip("jsonschema")
    await add_worker(stack, tiny_dir, max_num_batched_tokens=512)
    client = await stack.start_frontend()
    await stack.wait_for_model("tiny")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    async def chat(seed: int) -> dict:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Describe a pet as JSON."}],
            "max_tokens": 200,
            "seed": seed,
            "temperature": 1.0,
            "response_format": fmt,
        }
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    bodies = await asyncio.gather(*(chat(seed) for seed in range(50)))
    texts = [b["choices"][0]["message"]["content"] for b in bodies]
    for b, text in zip(bodies, texts, strict=True):
        assert b["choices"][0]["finish_reason"] == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 40  # seeded samples, not one forced string
    assert texts[7] == (await chat(7))["choices"][0]["message"]["content"]  # reproducible

    choices = ["Paris", "the lazy dog", "0 1 2"]
    r = await client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "The capital of France is",
            "max_tokens": 30,
            "seed": 3,
            "nvext": {"guided_choice": choices},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in choices
    r = await client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Numbers:",
            "max_tokens": 30,
            "seed": 4,
            "nvext": {"guided_regex": "[0-9]{2,5}( [a-z]{1,4}){0,2}"},
        },
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert re.fullmatch("[0-9]{2,5}( [a-z]{1,4}){0,2}", text), text
    r = await client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 5, "guided_regex": "(unclosed"},
    )
    assert r.status_code == 400, r.text
    assert "regex" in r.json()["error"]["message"]


async def test_max_tokens_beyond_the_context_is_a_400(stack: Stack, tiny_dir: Path) -> None:
    await add_worker(stack, tiny_dir, context_length=128)
    client = await stack.start_frontend()
    await stack.wait_for_model("tiny")
    prompt = list(range(5, 105))  # 100 tokens: 28 left
    r = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 29}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "context length" in error["message"]
    r = await client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 28, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 28

"""Disaggregated serving with the PyTorch engine, real processes (issue 16): a frontend and a
prefill + decode pair whose KV layouts differ (block size 32 on the prefill side, 16 on the
decode side). Every prompt is prefilled remotely and its KV moves worker to worker through the
transfer agents; greedy output equals the aggregated output (transformers' ``generate``, which
the aggregated engine is tested to match) for 20 prompts, several sharing prefixes (decode-side
prefix hits)."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("torch")

from tests.e2e.frontend.frontend_stack import Stack, request, wait_http  # noqa: E402
from tests.tiny_models import TEST_DEVICE, build, hf_greedy  # noqa: E402

pytestmark = pytest.mark.e2e

COMMON = ["--kv-cache-memory", "16MiB", "--torch-threads", "1", "--dtype", "float32"]
COMMON += ["--device", TEST_DEVICE]


def completion(port: int, model: str, prompt: list[int]) -> list[int]:
    status, _, body = request(
        port,
        "POST",
        "/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "nvext": {"annotations": ["token_ids"]},
        },
        timeout=60,
    )
    assert status == 200, body
    ids: list[int] = json.loads(body)["nvext"]["token_ids"]
    return ids


def metric(port: int, name: str) -> float:
    _, _, body = request(port, "GET", "/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith(name + "{")
    )


def test_pytorch_disagg_greedy_output_equals_aggregated(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = build("llama", tmp_path_factory.getbasetemp())
    model = str(model_dir)
    stack = Stack()
    try:

        def pytorch(name: str, *flags: str) -> Any:
            child = stack.spawn(
                ["-m", "dynamo.pytorch", "--model-path", model, "--model-name", name]
                + COMMON
                + list(flags)
            )
            return child

        workers = [
            pytorch("dis", "--block-size", "32", "--disaggregation-mode", "prefill"),
            pytorch(
                "dis",
                *("--block-size", "16", "--disaggregation-mode", "decode"),
                *("--system-host", "127.0.0.1", "--system-port", "0"),
            ),
        ]
        for w in workers:
            w.wait_for("serving model", timeout=90)
        stack.frontend("--router-mode", "kv", "--max-local-prefill-length", "0")
        wait_http(stack.port, "/v1/models")
        base = [(7 * i) % 300 + 20 for i in range(70)]
        prompts = [base[: 40 + i] for i in range(10)]  # shared prefixes: decode-side hits
        prompts += [[(13 * i + 5 * k) % 300 + 20 for i in range(33 + 3 * k)] for k in range(10)]
        for prompt in prompts:
            assert completion(stack.port, "dis", prompt) == hf_greedy(model_dir, prompt, 8)
        assert metric(stack.port, "dynamo_frontend_disagg_prefills_total") == 20
        line = workers[1].wait_for("status server listening on")
        decode_port = int(line.rsplit(":", 1)[1].split()[0])
        # every prompt's KV came over the transfer agents (the layouts differ: all of it)
        assert metric(decode_port, "dynamo_component_disagg_handoffs_total") == 20
        assert metric(decode_port, "dynamo_component_kv_transfer_bytes_total") > 0
    finally:
        stack.close()

"""``python -m dynamo.pytorch`` in a subprocess: serves a tiny model over the TCP request plane,
greedy output equals transformers', its engine metrics are on /metrics, SIGTERM exits 0; and
``dynamo serve --engine pytorch`` serves it over HTTP."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import httpx
import msgspec
import pytest

pytest.importorskip("torch")

from dynamo.protocol.output import FinishReason, LLMEngineOutput  # noqa: E402
from dynamo.protocol.request import (  # noqa: E402
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo.runtime.context import Context  # noqa: E402
from dynamo.runtime.naming import EndpointId  # noqa: E402
from dynamo.runtime.runtime import DistributedRuntime  # noqa: E402
from tests.e2e.frontend.frontend_stack import (  # noqa: E402
    child_env,
    request,
    wait_instances,
)
from tests.e2e.processes import Child, free_port  # noqa: E402
from tests.tiny_models import TEST_DEVICE, build, hf_greedy  # noqa: E402

pytestmark = pytest.mark.e2e
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(LLMEngineOutput)


async def test_pytorch_worker_process(
    spawn: Any, runtime: DistributedRuntime, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build("llama", tmp_path_factory.getbasetemp())
    proc = spawn(
        [
            "-m",
            "dynamo.pytorch",
            "--model-path",
            str(model),
            "--model-name",
            "tiny",
            "--block-size",
            "16",
            "--kv-cache-memory",
            "16MiB",
            "--torch-threads",
            "1",
            "--device",
            TEST_DEVICE,
            "--system-port",
            "0",
            "--system-host",
            "127.0.0.1",
        ]
    )
    client = await runtime.client(EndpointId("dynamo", "backend", "generate"))
    await client.wait_for_instances(1, timeout=60)
    (iid,) = client.instance_ids()
    prompt = list(range(10, 60))
    body = _enc.encode(
        PreprocessedRequest(
            model="tiny",
            token_ids=prompt,
            sampling=SamplingOptions(temperature=0.0),
            stop=StopConditions(max_tokens=8, ignore_eos=True),
        )
    )
    outs = [_dec.decode(raw) async for raw in client.stream(body, Context(), instance_id=iid)]
    assert [t for o in outs for t in o.token_ids] == hf_greedy(model, prompt, 8)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    line = proc.wait_for("status server listening on")
    port = int(line.rsplit(":", 1)[1].split()[0])
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    assert "dynamo_component_total_blocks" in metrics
    assert "dynamo_component_engine_output_tokens_total" in metrics
    proc.popen.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.popen.wait, 15) == 0


def test_dynamo_serve_engine_pytorch(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``dynamo serve --engine pytorch``: a frontend and a PyTorch worker process; greedy output
    over HTTP equals transformers'; SIGTERM stops both."""
    model = build("llama", tmp_path_factory.getbasetemp())
    port = free_port()
    serve = Child(
        ["-m", "dynamo.cli", "serve", "--engine", "pytorch", "--model-path", str(model)]
        + ["--model-name", "tiny", "--workers", "1", "--http-host", "127.0.0.1"]
        + ["--http-port", str(port), "--kv-cache-memory", "16MiB", "--torch-threads", "1"]
        + ["--device", TEST_DEVICE],
        child_env(),
    )
    try:
        assert "1 pytorch workers" in serve.wait_for(f"http://127.0.0.1:{port}")
        wait_instances(port, 1, timeout=60)
        prompt = list(range(20, 60))
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0.0,
            "ignore_eos": True,
            "nvext": {"annotations": ["token_ids"]},
        }
        status, _, raw = request(port, "POST", "/v1/completions", body)
        assert status == 200, raw
        assert json.loads(raw)["nvext"]["token_ids"] == hf_greedy(model, prompt, 6)
        serve.signal(signal.SIGTERM)
        assert serve.popen.wait(30) == 0, serve.tail()
        assert not any("Traceback" in line for line in serve.lines), serve.tail()
    finally:
        serve.stop()

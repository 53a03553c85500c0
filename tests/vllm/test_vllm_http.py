"""The whole HTTP stack on vLLM workers, real processes on loopback: a KV-routing frontend and
two ``python -m dynamo.vllm`` workers on a tiny random Llama built at test time.

Greedy output equals vLLM's own offline ``LLM.generate`` (a child process), streaming gives the
same tokens, stop strings end the text, a client that disconnects mid-stream gets vLLM's request
aborted (the worker's gauges, fed by vLLM's scheduler, go back to nothing running and no block in
use), and a repeated prefix is routed to the worker holding it (its KV events reached the
router). One stack per module (each vLLM start takes 30-70 s)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.frontend.frontend_stack import Stack, request, wait_instances
from tests.e2e.processes import REPO, Child
from tests.tiny_models import build
from tests.vllm.offline_greedy import BLOCK_SIZE, MAX_MODEL_LEN

pytestmark = pytest.mark.e2e
START_TIMEOUT = 600.0  # two vLLM starts at once on a loaded 2-core machine
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def worker_args(model: Path) -> list[str]:
    return [
        "-m",
        "dynamo.vllm",
        "--model-path",
        str(model),
        "--model-name",
        "tiny",
        "--system-port",
        "0",
        "--system-host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-gpu-blocks-override",
        "64",
        "--enforce-eager",
        "--enable-prefix-caching",
    ]


class VllmStack:
    def __init__(self, stack: Stack, workers: list[Child], model: Path) -> None:
        self.stack = stack
        self.workers = workers
        self.model = model
        self.status_ports = [
            int(w.wait_for("status server listening on").rsplit(":", 1)[1].split()[0])
            for w in workers
        ]

    @property
    def port(self) -> int:
        return self.stack.port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama_hd64", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def vllm_stack(model_dir: Path) -> Iterator[VllmStack]:
    stack = Stack()
    try:
        workers = [stack.spawn(worker_args(model_dir), **VLLM_ENV) for _ in range(2)]
        stack.frontend("--router-mode", "kv")
        for w in workers:
            w.wait_for("serving model", timeout=START_TIMEOUT)
        wait_instances(stack.port, 2, timeout=60)
        yield VllmStack(stack, workers, model_dir)
    finally:
        stack.close()


def offline_greedy(model: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    env = {**os.environ, **VLLM_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.offline_greedy", str(model), str(max_tokens)],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith('{"outputs"'))
    outputs: list[list[int]] = json.loads(line)["outputs"]
    return outputs


def completion(port: int, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "temperature": 0.0, **body}
    status, _, raw = request(port, "POST", "/v1/completions", body, timeout=120)
    assert status == 200, raw
    out: dict[str, Any] = json.loads(raw)
    return out


def worker_of(body: dict[str, Any]) -> int:
    return int(body["nvext"]["worker_id"]["decode_worker_id"])


PROMPTS = [[(i * 37 + j * 11) % 380 + 5 for j in range(40 + 23 * i)] for i in range(3)]


def test_greedy_equals_vllm_offline_generate(vllm_stack: VllmStack) -> None:
    expected = offline_greedy(vllm_stack.model, PROMPTS, 12)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        body = completion(
            vllm_stack.port,
            prompt=prompt,
            max_tokens=12,
            ignore_eos=True,
            nvext={"annotations": ["token_ids"]},
        )
        assert body["nvext"]["token_ids"] == want
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 12


def sse_events(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def test_streaming_gives_the_same_text(vllm_stack: VllmStack) -> None:
    prompt = PROMPTS[1]
    whole = completion(vllm_stack.port, prompt=prompt, max_tokens=16, ignore_eos=True)
    conn = http.client.HTTPConnection("127.0.0.1", vllm_stack.port, timeout=120)
    try:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
        body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        events = list(sse_events(resp))
    finally:
        conn.close()
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == whole["choices"][0]["text"]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 16


def test_stop_string_ends_the_text(vllm_stack: VllmStack) -> None:
    prompt = PROMPTS[2]
    whole = completion(vllm_stack.port, prompt=prompt, max_tokens=24, ignore_eos=True)
    text = whole["choices"][0]["text"]
    # A two-character stop string from the output's second third, without whitespace.
    at = next(i for i in range(len(text) // 3, len(text) - 1) if not text[i : i + 2].isspace())
    stop = text[at : at + 2]
    cut = completion(vllm_stack.port, prompt=prompt, max_tokens=24, ignore_eos=True, stop=[stop])
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def gauges(status_port: int) -> dict[str, float]:
    _, _, raw = request(status_port, "GET", "/metrics", timeout=10)
    out: dict[str, float] = {}
    for line in raw.decode().splitlines():
        for name in ("num_requests_running", "gpu_cache_usage_percent"):
            if line.startswith(f"dynamo_component_{name}{{"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def idle(vllm_stack: VllmStack) -> list[dict[str, float]]:
    """Until no worker runs a request or holds a block (60 s at most): the gauges then."""
    deadline = time.monotonic() + 60
    while True:
        now = [gauges(p) for p in vllm_stack.status_ports]
        if all(g["num_requests_running"] == 0 and g["gpu_cache_usage_percent"] == 0 for g in now):
            return now
        assert time.monotonic() < deadline, f"vLLM still runs a request: {now}"
        time.sleep(0.2)


def test_client_disconnect_aborts_vllm_request(vllm_stack: VllmStack) -> None:
    # An earlier test's request may still be ending on a worker (a stop string ends the
    # response at once; the engine's abort follows asynchronously): start from idle workers.
    idle(vllm_stack)
    conn = http.client.HTTPConnection("127.0.0.1", vllm_stack.port, timeout=120)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 1.0}
    body |= {"ignore_eos": True, "stream": True, "nvext": {"extra_fields": ["worker_id"]}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    for _ in sse_events(resp):
        seen += 1
        if seen == 3:
            break
    running = [gauges(p) for p in vllm_stack.status_ports]
    assert sum(g["num_requests_running"] for g in running) == 1, running
    conn.close()  # the client goes away mid-stream
    idle(vllm_stack)  # vLLM aborts the abandoned request and frees its blocks
    again = completion(vllm_stack.port, prompt=PROMPTS[0], max_tokens=2, ignore_eos=True)
    assert again["usage"]["completion_tokens"] == 2


STORED = 'dynamo_component_kv_cache_events_applied_total{event_type="stored",status="ok"}'


def stored_events_applied(port: int) -> float:
    """The KV events storing blocks the frontend's router has applied (all workers)."""
    _, _, raw = request(port, "GET", "/metrics", timeout=10)
    lines = raw.decode().splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(STORED))


def test_repeated_prefix_goes_to_the_worker_holding_it(vllm_stack: VllmStack) -> None:
    groups = 4
    prefixes = [
        [(g * 101 + j * 13) % 380 + 5 for j in range(6 * BLOCK_SIZE)] for g in range(groups)
    ]

    def ask(prompt: list[int]) -> dict[str, Any]:
        return completion(
            vllm_stack.port,
            prompt=prompt,
            max_tokens=2,
            ignore_eos=True,
            nvext={"extra_fields": ["worker_id"]},
        )

    # All first requests at once: the router counts the ones in flight, so they spread over
    # both workers (sequential ones would tie on an idle stack and be placed at random).
    applied = stored_events_applied(vllm_stack.port)
    with ThreadPoolExecutor(groups) as pool:
        firsts = list(pool.map(ask, [p + [7] for p in prefixes]))
    owners = {g: worker_of(body) for g, body in enumerate(firsts)}
    assert len(set(owners.values())) == 2, owners
    # Their KV events cross vLLM's socket and our event plane, and the answers can come first:
    # wait until the router applied at least one stored event a request (vLLM sends one per
    # request and step). On time out the assertions below show what the router lacked.
    deadline = time.monotonic() + 30
    while stored_events_applied(vllm_stack.port) < applied + groups:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for g, prefix in enumerate(prefixes):
        for unique in range(2):
            body = ask(prefix + [9, 10 + unique])
            assert worker_of(body) == owners[g], (g, unique, owners)
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == len(prefix), body["usage"]

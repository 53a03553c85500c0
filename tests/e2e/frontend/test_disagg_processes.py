"""Disaggregated serving with real processes (issue 16): a frontend, a prefill and a decode mocker
on loopback. Long prompts are prefilled remotely (both workers' /metrics show it), short ones
locally; a prefill worker killed mid-prefill gives the client an explicit error and leaves no
block held on the decode side; ``dynamo serve --prefill-workers 1 --decode-workers 1`` serves."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from tests.e2e.frontend.frontend_stack import (
    Child,
    Stack,
    child_env,
    free_port,
    request,
    wait_http,
)

pytestmark = pytest.mark.e2e

MOCKER = ("--block-size", "16", "--num-gpu-blocks-override", "2048", "--system-host", "127.0.0.1")


def long_prompt(tag: str, words: int = 400) -> str:
    return " ".join(f"{tag} word{i}" for i in range(words))


def chat(port: int, text: str, max_tokens: int = 4) -> tuple[int, dict[str, object]]:
    status, _, body = request(
        port,
        "POST",
        "/v1/chat/completions",
        {
            "model": "demo",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
        timeout=60,
    )
    return status, json.loads(body)


def metric_sum(port: int, name: str) -> float:
    _, _, body = request(port, "GET", "/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith(name + "{")
    )


def blocks_in_use(port: int) -> float:
    return metric_sum(port, "dynamo_component_gpu_cache_usage_percent")


def wait_for(check: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


def test_prefill_on_the_prefill_worker_and_its_death_fails_cleanly() -> None:
    stack = Stack()
    try:
        p_port, d_port = free_port(), free_port()
        # The prefill worker runs at 1/20 speed: a 2k-token prefill takes about a second.
        prefill = stack.mocker(
            "demo",
            *MOCKER,
            "--disaggregation-mode",
            "prefill",
            "--speedup-ratio",
            "0.05",
            DYN_SYSTEM_PORT=str(p_port),
            DYN_LEASE_TTL="2",
        )
        stack.mocker(
            "demo",
            *MOCKER,
            "--disaggregation-mode",
            "decode",
            "--speedup-ratio",
            "0",
            DYN_SYSTEM_PORT=str(d_port),
        )
        stack.frontend("--router-mode", "kv")
        wait_http(stack.port, "/v1/models")
        tries = iter(range(1000))  # a fresh prompt each try: no decode-side prefix hit
        wait_for(
            lambda: (
                chat(stack.port, long_prompt(f"warm{next(tries)}"))[0] == 200
                and metric_sum(p_port, "dynamo_component_disagg_handoffs_total") == 1
            ),
            "a long prompt prefilled on the prefill worker",
        )
        base = metric_sum(d_port, "dynamo_component_disagg_handoffs_total")
        assert base == 1
        for i in range(2):
            status, body = chat(stack.port, long_prompt(f"long{i}"))
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 4  # type: ignore[index]
        for i in range(2):
            assert chat(stack.port, f"short question {i}")[0] == 200
        assert metric_sum(p_port, "dynamo_component_disagg_handoffs_total") == 3
        assert metric_sum(d_port, "dynamo_component_disagg_handoffs_total") == 3
        assert blocks_in_use(d_port) == 0

        # Kill the prefill worker while it prefills: the client gets an explicit error.
        outcome: list[tuple[int, dict[str, object]]] = []
        waiting = threading.Thread(
            target=lambda: outcome.append(chat(stack.port, long_prompt("doomed", 700)))
        )
        waiting.start()
        # mid-prefill (its 5,352 tokens take about 2 s at 1/20 speed), not before it arrived:
        # on a loaded machine a fixed wait could kill the worker before the request reached it
        wait_for(
            lambda: metric_sum(p_port, "dynamo_component_inflight_requests") >= 1,
            "the doomed prompt prefilling on the prefill worker",
            timeout=20,
        )
        prefill.popen.send_signal(signal.SIGKILL)
        waiting.join(60)
        assert outcome, "the request hung"
        status, body = outcome[0]
        assert status >= 500 and "error" in body, body
        assert blocks_in_use(d_port) == 0
        # Once its lease is gone, long prompts are prefilled on the decode worker.
        tries = iter(range(1000))
        wait_for(
            lambda: chat(stack.port, long_prompt(f"after{next(tries)}"))[0] == 200,
            "a long prompt prefilled on the decode worker",
        )
        assert blocks_in_use(d_port) == 0
    finally:
        stack.close()


def test_dynamo_serve_runs_a_disaggregated_stack() -> None:
    port = free_port()
    child = Child(
        ["-m", "dynamo.serve", "--http-host", "127.0.0.1", "--http-port", str(port)]
        + ["--prefill-workers", "1", "--decode-workers", "1", "--speedup-ratio", "0"]
        + ["--router-mode", "kv"],
        child_env(None),
    )
    try:
        child.wait_for("1 prefill + 1 decode mocker workers")
        wait_http(port, "/v1/models")
        wait_for(
            lambda: (
                chat(port, long_prompt(f"serve{time.monotonic()}"))[0] == 200
                and any(
                    "disagg_prefills_total" in line and 'placement="remote"' in line
                    for line in request(port, "GET", "/metrics")[2].decode().splitlines()
                )
            ),
            "a remote prefill through dynamo serve",
        )
    finally:
        child.stop()


def test_queue_dispatch_across_processes_prefill_workers_join_and_leave() -> None:
    """Dispatch ``queue`` on one machine (the frontend hosts the prefill queue over its TCP
    request plane): under a steady load a second prefill worker joins and the first leaves on
    SIGTERM; no request fails, both workers' /metrics show the prefills they pulled."""
    stack = Stack()
    try:
        p1_port, p2_port = free_port(), free_port()
        prefill = ("--disaggregation-mode", "prefill", "--speedup-ratio", "1")
        first = stack.mocker("demo", *MOCKER, *prefill, DYN_SYSTEM_PORT=str(p1_port))
        stack.mocker("demo", *MOCKER, "--disaggregation-mode", "decode", "--speedup-ratio", "1")
        stack.frontend(
            "--router-mode", "kv", "--prefill-dispatch", "queue", "--max-prefill-queue-size", "1000"
        )
        wait_http(stack.port, "/v1/models")
        handoffs = "dynamo_component_disagg_handoffs_total"
        tries = iter(range(1000))
        wait_for(
            lambda: (
                chat(stack.port, long_prompt(f"warm{next(tries)}"))[0] == 200
                and metric_sum(p1_port, handoffs) >= 1
            ),
            "a long prompt prefilled through the queue",
        )
        failures: list[object] = []
        running = threading.Event()
        running.set()

        def load(c: int) -> None:
            i = 0
            while running.is_set():
                i += 1
                status, body = chat(stack.port, long_prompt(f"c{c}r{i}", 300))
                if status != 200:
                    failures.append(body)

        threads = [threading.Thread(target=load, args=(c,)) for c in range(4)]
        for t in threads:
            t.start()
        try:
            stack.mocker("demo", *MOCKER, *prefill, DYN_SYSTEM_PORT=str(p2_port))
            wait_for(lambda: metric_sum(p2_port, handoffs) >= 3, "the new prefill worker pulls")
            taken = metric_sum(p1_port, handoffs)
            first.popen.send_signal(signal.SIGTERM)
            assert first.popen.wait(30) == 0
            after = metric_sum(p2_port, handoffs)
            wait_for(
                lambda: metric_sum(p2_port, handoffs) >= after + 5, "the second one serves alone"
            )
        finally:
            running.clear()
            for t in threads:
                t.join(60)
        assert failures == []
        assert taken >= 1
    finally:
        stack.close()


def test_queue_dispatch_prefill_worker_killed_holding_a_task() -> None:
    """Dispatch ``queue``: the prefill worker holding a task is SIGKILLed mid-prefill. The host
    (the frontend) sees its request-plane connection drop and gives the task back at once: the
    other prefill worker prefills it and the client gets its answer long before the queue's
    30 s redelivery timeout, with nothing left in flight and the task prefilled only once more."""
    stack = Stack()
    try:
        ports = [free_port(), free_port()]
        # 1/20 speed: the doomed prompt's prefill takes over a second, time to kill its worker.
        prefill = ("--disaggregation-mode", "prefill", "--speedup-ratio", "0.05")
        workers = [
            stack.mocker("demo", *MOCKER, *prefill, DYN_SYSTEM_PORT=str(port)) for port in ports
        ]
        stack.mocker("demo", *MOCKER, "--disaggregation-mode", "decode", "--speedup-ratio", "0")
        stack.frontend("--router-mode", "kv", "--prefill-dispatch", "queue")
        wait_http(stack.port, "/v1/models")
        handoffs = "dynamo_component_disagg_handoffs_total"
        tries = iter(range(1000))
        wait_for(
            lambda: (
                chat(stack.port, long_prompt(f"warm{next(tries)}"))[0] == 200
                and sum(metric_sum(port, handoffs) for port in ports) >= 1
            ),
            "a long prompt prefilled through the queue",
        )
        inflight = "dynamo_component_inflight_requests"
        outcome: list[tuple[int, dict[str, object]]] = []
        waiting = threading.Thread(
            target=lambda: outcome.append(chat(stack.port, long_prompt("doomed", 700)))
        )
        waiting.start()
        holder: list[int] = []

        def someone_prefills() -> bool:
            holder[:] = [i for i, port in enumerate(ports) if metric_sum(port, inflight) > 0]
            return bool(holder)

        wait_for(someone_prefills, "a prefill worker takes the task", timeout=20)
        dead, survivor = holder[0], 1 - holder[0]
        before = metric_sum(ports[survivor], handoffs)
        workers[dead].popen.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        waiting.join(60)
        elapsed = time.monotonic() - killed_at
        assert outcome, "the request hung"
        status, body = outcome[0]
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4  # type: ignore[index]
        assert elapsed < 10, f"the task came back after {elapsed:.1f}s (redelivery timeout?)"
        assert metric_sum(ports[survivor], handoffs) == before + 1
        assert metric_sum(ports[survivor], inflight) == 0
        assert metric_sum(stack.port, "dynamo_frontend_disagg_remote_prefills_inflight") == 0
        # Nothing stranded in the queue: the next long prompt is prefilled by the survivor.
        status, body = chat(stack.port, long_prompt("after", 300))
        assert status == 200, body
        assert metric_sum(ports[survivor], handoffs) == before + 2
    finally:
        stack.close()

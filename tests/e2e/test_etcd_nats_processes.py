"""The many-machines shape with real processes on loopback: etcd discovery and the NATS event
plane (frontend with the KV router + two mocker workers), then a worker SIGKILLed (keepalives
stop) and gone for the frontend within the lease TTL. The workers' model directory is deleted
before the frontend starts: the frontend builds its pipeline from the files the workers
published in discovery, not from a path on their disk."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.frontend.frontend_stack import DEMO_MODEL, Stack, request, wait_instances
from tests.e2e.processes import free_port
from tests.servers import EtcdServer, NatsServer

LEASE_TTL = 2


@pytest.fixture
def stack(etcd_server: EtcdServer, nats_server: NatsServer) -> Iterator[Stack]:
    s = Stack()
    yield s
    s.close()


def planes_env(etcd: EtcdServer, nats: NatsServer) -> dict[str, str]:
    return {
        "DYN_DISCOVERY_BACKEND": "etcd",
        "ETCD_ENDPOINTS": etcd.endpoint,
        "DYN_EVENT_PLANE": "nats",
        "NATS_SERVER": nats.url,
        "DYN_LEASE_TTL": str(LEASE_TTL),
    }


def etcd_keys(etcd: EtcdServer, prefix: str) -> list[str]:
    import base64

    from dynamo.runtime.discovery.etcd_gateway import prefix_range_end

    body = {
        "key": base64.b64encode(prefix.encode()).decode(),
        "range_end": base64.b64encode(prefix_range_end(prefix.encode())).decode(),
        "keys_only": True,
    }
    kvs = httpx.post(f"{etcd.endpoint}/v3/kv/range", json=body).json().get("kvs", [])
    return [base64.b64decode(kv["key"]).decode() for kv in kvs]


STORED = 'dynamo_component_kv_cache_events_applied_total{event_type="stored",status="ok"}'


def stored_events_applied(port: int) -> float:
    """The KV events storing blocks the frontend's router has applied (all workers)."""
    _, _, raw = request(port, "GET", "/metrics")
    lines = [line for line in raw.decode().splitlines() if line.startswith(STORED)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def cached_tokens_of_repeats(port: int, prompt: str, times: int) -> list[int]:
    """The cached prompt tokens of ``times`` completions of ``prompt``, one after another, the
    later ones once the first one's KV events (it cached nothing: it stores every block)
    reached the router over NATS (another process: the answer can come first, and a fixed wait
    is a guess on a loaded machine)."""
    cached: list[int] = []
    applied = stored_events_applied(port)
    for _ in range(times):
        status, _, body = request(
            port, "POST", "/v1/completions", {"model": "demo", "prompt": prompt, "max_tokens": 2}
        )
        assert status == 200, body
        usage = json.loads(body)["usage"]
        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        deadline = time.monotonic() + 30
        while cached == [0] and stored_events_applied(port) <= applied:
            assert time.monotonic() < deadline, "the first request's KV events never arrived"
            time.sleep(0.05)
    return cached


def test_kv_routing_over_etcd_and_nats_then_a_worker_dies(
    stack: Stack, etcd_server: EtcdServer, nats_server: NatsServer, tmp_path: Path
) -> None:
    env = planes_env(etcd_server, nats_server)
    model_dir = tmp_path / "worker-host-model"
    shutil.copytree(DEMO_MODEL, model_dir)
    workers = [
        stack.spawn(
            ["-m", "dynamo.mocker", "--model-path", str(model_dir), "--model-name", "demo"]
            + ["--speedup-ratio", "0"],
            **env,
        )
        for _ in range(2)
    ]
    for worker in workers:
        worker.wait_for("serving model")
    shutil.rmtree(model_dir)  # the frontend's host has no copy of the model
    stack.frontend("--router-mode", "kv", **env)
    wait_instances(stack.port, 2)
    assert len(etcd_keys(etcd_server, "v1/instances/dynamo/backend/generate/")) == 2

    # KV events reach the router through NATS: a repeated prompt goes where its blocks are.
    prompt = " ".join(f"word{i}" for i in range(300))
    cached = cached_tokens_of_repeats(stack.port, prompt, 4)
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached

    # SIGKILL: no revoke, no goodbye. The lease expires and the frontend drops the instance.
    workers[0].popen.kill()
    started = time.monotonic()
    wait_instances(stack.port, 1, timeout=LEASE_TTL + 15)
    assert time.monotonic() - started <= LEASE_TTL + 10
    status, _, body = request(
        stack.port, "POST", "/v1/completions", {"model": "demo", "prompt": prompt, "max_tokens": 2}
    )
    assert status == 200, body


def test_dynamo_serve_runs_the_whole_stack_on_etcd_and_nats(
    stack: Stack, etcd_server: EtcdServer, nats_server: NatsServer
) -> None:
    """`dynamo serve --discovery-backend etcd --event-plane nats` (flags, not the environment):
    its frontend and two mockers register in etcd and route by KV events over NATS."""
    stack.port = free_port()
    stack.spawn(
        ["-m", "dynamo.serve", "--http-host", "127.0.0.1", "--http-port", str(stack.port)]
        + ["--speedup-ratio", "0", "--router-mode", "kv"]
        + ["--discovery-backend", "etcd", "--etcd-endpoints", etcd_server.endpoint]
        + ["--event-plane", "nats", "--nats-server", nats_server.url]
    )
    wait_instances(stack.port, 2, timeout=60)
    assert len(etcd_keys(etcd_server, "v1/instances/dynamo/backend/generate/")) == 2
    assert etcd_keys(etcd_server, "v1/mdc/dynamo/")
    prompt = " ".join(f"token{i}" for i in range(300))
    cached = cached_tokens_of_repeats(stack.port, prompt, 3)
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached

"""The worker's status server (FACTS §8): /health, /live, /metrics on DYN_SYSTEM_PORT."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e


def status_port(proc: Any) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for text in proc.lines:
            m = re.search(r"status server listening on 127\.0\.0\.1:(\d+)", text)
            if m:
                return int(m.group(1))
        time.sleep(0.05)
    raise AssertionError(proc.lines)


def test_status_server_health_live_metrics(spawn: Any) -> None:
    proc = spawn(
        [
            "-m",
            "dynamo.mocker",
            "--model-path",
            "dynamo/models/demo",
            "--model-name",
            "demo",
            "--speedup-ratio",
            "0",
            "--system-host",
            "127.0.0.1",
        ],
        DYN_SYSTEM_PORT="0",
    )
    listening = None
    deadline = time.monotonic() + 20
    while listening is None and time.monotonic() < deadline:
        for text in proc.lines:
            m = re.search(r"status server listening on 127\.0\.0\.1:(\d+)", text)
            if m:
                listening = int(m.group(1))
        time.sleep(0.05)
    assert listening, proc.lines
    base = f"http://127.0.0.1:{listening}"
    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(f"{base}/health")
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ready" and body["endpoints"] == {"generate": "ready"}
    assert set(body["uptime"]) == {"secs", "nanos"}
    assert httpx.get(f"{base}/live").status_code == 200
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "dynamo_component_requests_total" in metrics.text
    assert 'dynamo_component="backend"' in metrics.text
    assert "dynamo_component_uptime_seconds" in metrics.text
    for gauge in (  # the mocker's engine gauges (reference names)
        "dynamo_component_total_blocks",
        "dynamo_component_gpu_cache_usage_percent",
        "dynamo_component_num_requests_running",
        "dynamo_component_num_requests_waiting",
    ):
        assert re.search(rf'^{gauge}{{.*model="demo".*}} ', metrics.text, re.M), gauge
    assert httpx.get(f"{base}/nope").status_code == 404
    proc.popen.send_signal(signal.SIGTERM)
    proc.popen.wait(15)


MOCKER = ["-m", "dynamo.mocker", "--model-path", "dynamo/models/demo", "--model-name", "demo"]
MOCKER += ["--speedup-ratio", "0", "--system-host", "127.0.0.1"]


def _canary_failed(proc: Any) -> bool:
    return any("health check of" in line and "failed" in line for line in proc.lines)


def health_after(proc: Any, seconds: float, canary_fails: bool) -> int:
    """/health once the worker served (200 seen) or, where its canary fails, once the first
    canary failed: that can come within 0.2 s of serving, faster than a loaded machine polls."""
    base = f"http://127.0.0.1:{status_port(proc)}"
    deadline = time.monotonic() + 20
    while not (_canary_failed(proc) if canary_fails else httpx.get(f"{base}/health").is_success):
        assert time.monotonic() < deadline, proc.lines
        time.sleep(0.05)
    time.sleep(seconds)  # several canary periods
    return httpx.get(f"{base}/health").status_code


@pytest.mark.parametrize(
    ("payload", "status", "instances"),
    [
        (None, 200, 1),  # the mocker's own one-token canary passes
        ('{"token_ids": [1], "stop_conditions": {"max_tokens": 1000000}}', 503, 0),  # refused
    ],
)
def test_canaries_from_the_environment(
    spawn: Any, discovery_dir: str, payload: str | None, status: int, instances: int
) -> None:
    env = {"DYN_SYSTEM_PORT": "0", "DYN_HEALTH_CHECK_ENABLED": "true"}
    env |= {"DYN_CANARY_WAIT_TIME": "0.2", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1"}
    if payload is not None:
        env["DYN_HEALTH_CHECK_PAYLOAD"] = payload
    proc = spawn(MOCKER, **env)
    assert health_after(proc, 1.0, canary_fails=status == 503) == status
    generate = "instances%2Fdynamo%2Fbackend%2Fgenerate%2F"  # the file backend's key encoding
    keys = [p for p in Path(discovery_dir).rglob("*") if p.is_file() and generate in p.name]
    assert len(keys) == instances, keys
    if status == 503:
        assert _canary_failed(proc)
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(15) == 0
    assert not any("Traceback" in line for line in proc.lines), json.dumps(proc.lines[-20:])

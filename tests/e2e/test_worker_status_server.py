"""The worker's status server (FACTS §8): /health, /live, /metrics on DYN_SYSTEM_PORT."""

from __future__ import annotations

import re
import signal
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e


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

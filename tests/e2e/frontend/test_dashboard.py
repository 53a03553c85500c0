"""The live dashboard against a running stack (a frontend and two mockers as processes): its JSON
and the page, rendered by headless Chromium (``scripts/install_chromium.sh``, run by
``make test``), show the numbers ``/metrics`` has; a screenshot is kept as a test artifact
(``$DYN_TEST_ARTIFACTS`` or ``<tmp>/dynamo-artifacts``)."""

from __future__ import annotations

import html.parser
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo.frontend.dashboard import histogram_quantile
from tests.e2e.frontend.frontend_stack import Stack, request, wait_instances

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str | None:
    return next((b for b in map(shutil.which, BROWSERS) if b), None)


def artifacts_dir() -> Path:
    root = os.environ.get("DYN_TEST_ARTIFACTS") or os.path.join(
        tempfile.gettempdir(), "dynamo-artifacts"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels: dict[str, str] = {}
        for part in rest.rstrip("}").split('",') if rest else []:
            k, _, v = part.partition("=")
            labels[k.strip(",")] = v.strip('"')
        out.append((name, labels, float(value)))
    return out


class Cells(html.parser.HTMLParser):
    """The text of every element with a ``data-k`` attribute, grouped by the row it is in."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = [{}]
        self._key: str | None = None
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append({})
        if self._key is not None:
            self._depth += 1
            return
        key = dict(attrs).get("data-k")
        if key:
            self._key, self._depth = key, 0
            self.rows[-1][key] = ""

    def handle_endtag(self, tag: str) -> None:
        if self._key is None:
            return
        if self._depth == 0:
            self._key = None
        else:
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        if self._key is not None:
            self.rows[-1][self._key] += data


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack()
    try:
        s.frontend("--router-mode", "kv")
        for _ in range(2):
            s.mocker("demo", "--speedup-ratio", "20", "--block-size", "16")
        wait_instances(s.port, 2)
        yield s
    finally:
        s.close()


def traffic(port: int, n: int) -> None:
    for i in range(n):
        status, _, _ = request(
            port,
            "POST",
            "/v1/chat/completions",
            {
                "model": "demo",
                "messages": [{"role": "user", "content": f"shared prefix {'x ' * 40} q{i % 3}"}],
                "max_tokens": 4,
                "stream": i % 2 == 0,
            },
        )
        assert status == 200


def wait_loads_published(port: int, timeout_s: float = 10.0) -> None:
    """Until every worker that served a request shows the load it published."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, _, raw = request(port, "GET", "/dashboard/data")
        workers = json.loads(raw)["workers"]
        if all(w["kv_total_blocks"] for w in workers if w["requests_served"]):
            return
        assert time.monotonic() < deadline, workers
        time.sleep(0.05)


def test_dashboard_in_headless_chromium_matches_metrics(stack: Stack) -> None:
    chrome = browser()
    if chrome is None:
        pytest.skip("no Chromium: run scripts/install_chromium.sh (make test does)")
    traffic(stack.port, 8)
    # A worker publishes its load when it changes, at most every 20 ms and asynchronously: wait
    # until every worker that served has sent one (a CI run read the page before one arrived).
    wait_loads_published(stack.port)
    _, _, raw = request(stack.port, "GET", "/metrics")
    samples = parse_metrics(raw.decode())
    _, _, data_raw = request(stack.port, "GET", "/dashboard/data")
    data = json.loads(data_raw)
    # The JSON agrees with /metrics.
    total = sum(v for n, lb, v in samples if n == "dynamo_frontend_requests_total")
    assert total == 8 and data["requests_total"] == total
    (model,) = data["models"]
    assert model["name"] == "demo" and model["ready"] and len(model["roles"]["agg"]) == 2
    buckets = sorted(
        (float(lb["le"]), v)
        for n, lb, v in samples
        if n == "dynamo_frontend_time_to_first_token_seconds_bucket" and lb["model"] == "demo"
    )
    assert model["ttft_s"]["p50"] == pytest.approx(histogram_quantile(0.5, buckets))
    assert model["ttft_s"]["p99"] == pytest.approx(histogram_quantile(0.99, buckets))
    assert model["request_rate"] > 0
    workers = {w["worker_id"]: w for w in data["workers"]}
    assert len(workers) == 2
    blocks = {
        lb["worker_id"]: v
        for n, lb, v in samples
        if n == "dynamo_frontend_worker_active_decode_blocks"
    }
    assert {w: workers[w]["router_active_decode_blocks"] for w in workers} == blocks
    assert all(w["kv_total_blocks"] for w in workers.values() if w["requests_served"])
    assert sum(w["requests_served"] for w in workers.values()) == 8
    assert any(w["prefix_hit_rate"] for w in workers.values())  # shared prefixes hit
    assert len(data["decisions"]) == 8
    # The page, rendered by a real browser, shows the same numbers.
    url = f"http://127.0.0.1:{stack.port}/dashboard"
    profile = tempfile.mkdtemp(prefix="dyn-chromium-")
    flags = [
        chrome,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=3000",
    ]
    try:
        dom = subprocess.run(
            [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=True
        ).stdout
        shot = artifacts_dir() / "dashboard.png"
        shot.unlink(missing_ok=True)
        subprocess.run(
            [*flags, "--window-size=1400,900", f"--screenshot={shot}", url],
            capture_output=True,
            timeout=90,
            check=True,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert 'data-loaded="1"' in dom, dom[:2000]
    cells = Cells()
    cells.feed(dom)
    page_total = next(r["requests_total"] for r in cells.rows if "requests_total" in r)
    assert int(page_total) == total
    row = next(r for r in cells.rows if r.get("name") == "demo")
    assert row["roles"] == "agg: 2" and row["ready"] == "yes"
    p50_ms = float(row["ttft_ms"].split(" / ")[0])
    assert p50_ms == pytest.approx(model["ttft_s"]["p50"] * 1000, abs=0.06)
    shown = {r["worker_id"]: r for r in cells.rows if "router_active_decode_blocks" in r}
    assert set(shown) == set(blocks)
    for wid, value in blocks.items():
        assert float(shown[wid]["router_active_decode_blocks"]) == value
    assert len([r for r in cells.rows if "outcome" in r]) == 8
    assert shot.exists() and shot.stat().st_size > 10_000

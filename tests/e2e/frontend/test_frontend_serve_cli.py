"""`dynamo serve`: prints the URL and a curl example, serves, and stops every child on SIGTERM
(no orphans); `dynamo serve --in-process` serves requests in one process."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.frontend.frontend_stack import Child, child_env, free_port, request, wait_http

pytestmark = pytest.mark.e2e


def children_of(pid: int) -> set[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.update(int(x) for x in (task / "children").read_text().split())
        except OSError:
            continue
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def chat_ok(port: int) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, _, raw = request(port, "POST", "/v1/chat/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 3


def test_dynamo_serve_prints_url_and_curl_and_stops_children_on_sigterm() -> None:
    port = free_port()
    serve = Child(
        ["-m", "dynamo.cli", "serve", "--http-host", "127.0.0.1", "--http-port", str(port)]
        + ["--workers", "2", "--speedup-ratio", "0"]
        + ["--max-inflight-requests", "8"],  # a frontend flag: once it killed the mockers
        child_env(),
    )
    try:
        url_line = serve.wait_for(f"http://127.0.0.1:{port}")
        assert "demo" in url_line
        curl_line = serve.wait_for("curl ")
        wait_http(port, "/health")
        chat_ok(port)
        kids = children_of(serve.popen.pid)
        assert len(kids) == 3, kids  # the frontend and two mockers
        if shutil.which("curl"):  # the printed example works as printed
            cmd = curl_line[curl_line.index("curl ") :]
            out = subprocess.run(shlex.split(cmd), capture_output=True, timeout=30, check=True)
            assert json.loads(out.stdout)["object"] == "chat.completion"

        serve.signal(signal.SIGTERM)
        assert serve.popen.wait(30) == 0, serve.tail()
        deadline = time.monotonic() + 5
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [k for k in kids if alive(k)], "orphaned children after SIGTERM"
        assert not any("Traceback" in line for line in serve.lines), serve.tail()
    finally:
        serve.stop()
        for k in children_of(serve.popen.pid) if alive(serve.popen.pid) else set():
            os.kill(k, signal.SIGKILL)


def test_dynamo_serve_in_process_serves_and_stops_on_sigint() -> None:
    port = free_port()
    serve = Child(
        ["-m", "dynamo.serve", "--in-process", "--http-host", "127.0.0.1"]
        + ["--http-port", str(port), "--workers", "2", "--speedup-ratio", "0"]
        + ["--system-port", "0"],
        child_env(),
    )
    try:
        serve.wait_for(f"http://127.0.0.1:{port}")
        wait_http(port, "/health")
        chat_ok(port)
        # --system-port 0: each in-process worker runs its own status server on a free port.
        status_ports = {
            int(m.group(1))
            for line in serve.lines
            if (m := re.search(r"status server listening on 127\.0\.0\.1:(\d+)", line))
        }
        assert len(status_ports) == 2, serve.tail()
        for status_port in status_ports:
            status, _, raw = request(status_port, "GET", "/health")
            assert status == 200 and json.loads(raw)["status"] == "ready", raw
        body = {"model": "demo", "prompt": "Once", "max_tokens": 4, "stream": True}
        status, _, raw = request(port, "POST", "/v1/completions", body)
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
        status, _, raw = request(port, "GET", "/v1/models")
        assert [m["id"] for m in json.loads(raw)["data"]] == ["demo"]
        assert children_of(serve.popen.pid) == set()  # one process
        serve.signal(signal.SIGINT)
        assert serve.popen.wait(30) == 0, serve.tail()
        assert not any("Traceback" in line for line in serve.lines), serve.tail()
    finally:
        serve.stop()

"""Helpers for the frontend's end-to-end tests: `dynamo serve`, frontends and mockers as
subprocesses on loopback with ephemeral ports, and a small raw HTTP client."""

from __future__ import annotations

import http.client
import json
import os
import tempfile
import time
from typing import Any

from tests.e2e.processes import REPO, Child, free_port

DEMO_MODEL = str(REPO / "dynamo" / "models" / "demo")


def child_env(discovery_dir: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):  # the tests choose every DYN_* setting themselves
        if key.startswith("DYN_"):
            del env[key]
    env["PYTHONUNBUFFERED"] = "1"
    # A worker's status server binds 0.0.0.0 by default; tests use loopback only.
    env["DYN_SYSTEM_HOST"] = "127.0.0.1"
    if discovery_dir is not None:
        env["DYN_FILE_KV"] = discovery_dir
    env.update(extra)
    return env


def request(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 30.0,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request on a fresh connection: (status, lower-cased headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        out = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, out
    finally:
        conn.close()


def wait_http(port: int, path: str, status: int = 200, timeout: float = 40.0) -> bytes:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            code, _, body = request(port, "GET", path, timeout=2)
            if code == status:
                return body
            last = (code, body[:200])
        except OSError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"GET {path} never gave {status}; last {last!r}")


class Stack:
    """Processes of one test module, stopped (and checked for leftovers) at teardown."""

    def __init__(self) -> None:
        self.discovery_dir = tempfile.mkdtemp(prefix="dyn-fe-test-")
        self.children: list[Child] = []
        self.port = 0

    def spawn(self, args: list[str], **env: str) -> Child:
        child = Child(args, child_env(self.discovery_dir, **env))
        self.children.append(child)
        return child

    def frontend(self, *flags: str, **env: str) -> Child:
        self.port = free_port()
        child = self.spawn(
            ["-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(self.port)]
            + list(flags),
            **env,
        )
        child.wait_for("listening on http://")
        return child

    def mocker(self, model: str, *flags: str, **env: str) -> Child:
        child = self.spawn(
            ["-m", "dynamo.mocker", "--model-path", DEMO_MODEL, "--model-name", model, *flags],
            **env,
        )
        child.wait_for("serving model")
        return child

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()
        import shutil

        shutil.rmtree(self.discovery_dir, ignore_errors=True)


def wait_instances(port: int, n: int, timeout: float = 40.0) -> None:
    """Until /health lists ``n`` live instances."""
    deadline = time.monotonic() + timeout
    count = -1
    while time.monotonic() < deadline:
        try:
            _, _, body = request(port, "GET", "/health", timeout=2)
            count = len(json.loads(body).get("instances", []))
            if count == n:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"/health never listed {n} instances (last {count})")

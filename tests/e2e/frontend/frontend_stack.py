"""Helpers for the frontend's end-to-end tests: `dynamo serve`, frontends and mockers as
subprocesses on loopback with ephemeral ports, and a small raw HTTP client."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
DEMO_MODEL = str(REPO / "dynamo" / "models" / "demo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Child:
    """A child process whose output lines are collected by a reader thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a SIGINT to pytest does not reach it twice
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, fragment: str, timeout: float = 30.0) -> str:
        with self._cond:
            self._cond.wait_for(
                lambda: any(fragment in x for x in self.lines) or self.popen.poll() is not None,
                timeout,
            )
            for line in self.lines:
                if fragment in line:
                    return line
        raise AssertionError(f"no line with {fragment!r} (rc={self.popen.poll()}):\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._reader.join(timeout=5)
        if self.popen.stdout is not None and not self._reader.is_alive():
            self.popen.stdout.close()
        return self.popen.returncode


def child_env(discovery_dir: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):  # the tests choose every DYN_* setting themselves
        if key.startswith("DYN_"):
            del env[key]
    env["PYTHONUNBUFFERED"] = "1"
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

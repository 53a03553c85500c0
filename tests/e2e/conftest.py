"""Shared fixtures for end-to-end tests: subprocess management on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class Proc:
    """A child process whose stdout lines are collected by a reader thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            args,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
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

    def wait_for_line(self, prefix: str, timeout: float = 20.0) -> str:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    any(line.startswith(prefix) for line in self.lines)
                    or self.popen.poll() is not None
                ),
                timeout,
            )
            for line in self.lines:
                if line.startswith(prefix):
                    return line
        raise AssertionError(
            f"no line {prefix!r} (ok={ok}, rc={self.popen.poll()}):\n" + "\n".join(self.lines[-40:])
        )

    def index_of(self, fragment: str) -> int:
        for i, line in enumerate(self.lines):
            if fragment in line:
                return i
        return -1

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._reader.join(timeout=5)


@pytest.fixture
def discovery_dir(tmp_path: Path) -> str:
    d = tmp_path / "discovery"
    d.mkdir()
    return str(d)


@pytest.fixture
def spawn(discovery_dir: str) -> Iterator[object]:
    procs: list[Proc] = []

    def _spawn(args: list[str], **env_extra: str) -> Proc:
        env = dict(os.environ)
        env["DYN_FILE_KV"] = discovery_dir
        env["PYTHONUNBUFFERED"] = "1"
        env.update(env_extra)
        proc = Proc([sys.executable, *args], env)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        proc.stop()

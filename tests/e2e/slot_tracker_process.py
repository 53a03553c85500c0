"""A real slot tracker subprocess on loopback, for the slot tracker's end-to-end tests."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

READY = "slot tracker listening on "


class SlotTracker:
    """``python -m dynamo.slot_tracker --host 127.0.0.1 --port 0`` plus ``args``; ``url`` from
    its ready line, and the lines it printed up to it in ``lines``."""

    def __init__(self, *args: str) -> None:
        self._stderr = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "dynamo.slot_tracker", "--host", "127.0.0.1", "--port", "0"]
        # Unbuffered: select() must see every line still unread.
        self.proc = subprocess.Popen(
            [*cmd, *args], stdout=subprocess.PIPE, stderr=self._stderr, bufsize=0
        )
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 30
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline().decode()
                if not line:
                    err = self.stderr()
                    self.stop()
                    raise RuntimeError(f"slot tracker exited: {err}")
                self.lines.append(line.strip())
                if line.startswith(READY):
                    self.url = line.split()[-1]
                    break
            if time.monotonic() > deadline:
                err = self.stderr()
                self.stop()
                raise RuntimeError(f"slot tracker did not start: {err}")
        self.client = httpx.Client(base_url=self.url, timeout=10)

    def line(self, prefix: str) -> str | None:
        """The first line it printed before it was ready that starts with ``prefix``."""
        return next((line for line in self.lines if line.startswith(prefix)), None)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.client.post(path, json=body)

    def stop(self) -> int | None:
        if hasattr(self, "client"):
            self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        return self.proc.returncode

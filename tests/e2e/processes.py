"""Subprocesses for end-to-end tests: a child whose output lines are collected, free ports."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXIT_DRAIN_S = 5.0
"""How long, once a child has exited, its reader may take to collect the lines still in the
pipe (a grandchild that inherited the pipe may keep it open: not waited for past this)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Child:
    """A child process whose output lines are collected by a reader thread."""

    def __init__(
        self, args: list[str], env: dict[str, str], *, prefix: tuple[str, ...] = ()
    ) -> None:
        """``prefix`` wraps the command (``("ip", "netns", "exec", NAME)``: run it inside a
        network namespace; ``ip netns exec`` execs, so signals reach the child itself)."""
        self.args = args
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a SIGINT to pytest does not reach it twice
        )
        self.lines: list[str] = []
        self._eof = False  # the child closed its output (exited, or will): stop waiting
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, fragment: str, timeout: float = 30.0) -> str:
        """The first output line containing ``fragment`` (waits for it; fails if none)."""
        return self._wait(lambda line: fragment in line, repr(fragment), timeout)

    def wait_for_line(self, prefix: str, timeout: float = 20.0) -> str:
        """The first output line starting with ``prefix``."""
        return self._wait(lambda line: line.startswith(prefix), f"starting {prefix!r}", timeout)

    def index_of(self, fragment: str) -> int:
        """Index of the first line containing ``fragment`` so far, or -1."""
        with self._cond:
            return next((i for i, line in enumerate(self.lines) if fragment in line), -1)

    def output(self) -> list[str]:
        """Every line of an exited child: its reader may still be collecting the last ones from
        the pipe when ``popen.wait()`` returns (a loaded machine runs it late)."""
        self._reader.join(EXIT_DRAIN_S)
        with self._cond:
            return list(self.lines)

    def _wait(self, match: Callable[[str], bool], what: str, timeout: float) -> str:
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    any(match(x) for x in self.lines) or self._eof or self.popen.poll() is not None
                ),
                timeout,
            )
        if self.popen.poll() is not None:
            self._reader.join(EXIT_DRAIN_S)  # exited: its last lines may be in the pipe still
        with self._cond:
            for line in self.lines:
                if match(line):
                    return line
        raise AssertionError(f"no line {what} (rc={self.popen.poll()}):\n{self.tail()}")

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

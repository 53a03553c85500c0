"""Starting and stopping the services a benchmark measures: one module for every benchmark.

A :class:`Child` is a service process (``python -m dynamo.frontend``, ``dynamo.mocker``,
``dynamo.serve``, or the reference's, from another interpreter) whose output lines are collected
by a thread, so that a benchmark can wait for a line (readiness), keep or print the log, and
read the process's CPU time (:func:`cpu_seconds`, all its threads, from ``/proc``).
:func:`wait_model` waits until a frontend lists a model; :func:`free_port` picks a loopback port
for a service that cannot be told to bind port 0 and report it.

Only loopback addresses: the reference's services get theirs from its own settings
(:data:`REFERENCE_LOOPBACK`, its frontend's ``--http-host``), but some of its sockets have no
such setting (its ZMQ event publishers bind ``tcp://0.0.0.0``, its slot tracker ``0.0.0.0``), so
a benchmark that starts the reference first moves itself into a network namespace of its own
(:func:`isolate_network`), where the only interface is its loopback.

    from launcher import Child, free_port, service_env, wait_model
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "dynamo" / "models" / "demo"
PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
"""Flags for file discovery, the TCP request plane and ZMQ events (the reference's defaults
are etcd and NATS)."""
LISTENING = "dynamo frontend: listening on http://"
"""The line our frontend prints once it accepts connections (it ends with the port)."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
REFERENCE_LOOPBACK = {
    "DYN_SYSTEM_HOST": "127.0.0.1",  # its system status server (default 0.0.0.0)
    "DYN_TCP_RPC_HOST": "127.0.0.1",  # its TCP request plane (default: the host's address)
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",  # its response streams
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",  # the address its ZMQ publishers advertise
}
"""The reference's own settings for the addresses its services bind or advertise."""
ISOLATED = "DYN_BENCH_NETNS"
"""Set (to 1) in a benchmark that :func:`isolate_network` moved into its own namespace."""


def isolate_network() -> bool:
    """Run this benchmark (re-executed: the same interpreter and arguments) in a new network
    namespace whose only interface is a loopback, so that no socket it or its children open
    is reachable from outside, whatever address they bind; True when already there. Needs the
    right to create one (root, as here); without it, says so and returns False (the run goes on
    in the host's namespace)."""
    if os.environ.get(ISOLATED) == "1":
        return True
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    probe = [unshare or "unshare", "--net", "--", ip or "ip", "link", "set", "lo", "up"]
    if unshare is None or ip is None or subprocess.run(probe, capture_output=True).returncode:
        print(
            "# warning: no private network namespace (needs unshare, ip and the right to use "
            "them): the reference's ZMQ publishers and slot tracker listen on 0.0.0.0",
            file=sys.stderr,
        )
        return False
    script = 'ip link set lo up && exec "$@"'
    command = [unshare, "--net", "--", "sh", "-c", script, "sh", sys.executable]
    os.execve(unshare, command + sys.orig_argv[1:], dict(os.environ, **{ISOLATED: "1"}))


def free_port() -> int:
    """A loopback port free now (a service that binds port 0 itself avoids the race)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def service_env(discovery_dir: str | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a service: unbuffered output (lines arrive as printed),
    file discovery in ``discovery_dir`` when given, and ``extra``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if discovery_dir is not None:
        env["DYN_FILE_KV"] = discovery_dir
    env.update(extra)
    return env


class Child:
    """A service process whose output lines (stdout and stderr) are collected.

    ``python`` other than ours runs outside the checkout, without ``PYTHONPATH``, so that
    ``-m dynamo...`` imports that interpreter's own package."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: Mapping[str, str],
        python: str = sys.executable,
    ) -> None:
        self.name = name
        ours = python == sys.executable
        self.proc = subprocess.Popen(
            [python, *args],
            cwd=REPO if ours else tempfile.gettempdir(),
            env=dict(env) if ours else {k: v for k, v in env.items() if k != "PYTHONPATH"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def has_line(self, fragment: str) -> bool:
        return any(fragment in line for line in list(self.lines))

    def wait_line(self, fragment: str, timeout: float = 60.0) -> str:
        """The first output line containing ``fragment``, waiting up to ``timeout`` seconds;
        RuntimeError (with the log's tail) if the process exits or the time runs out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if fragment in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not print {fragment!r}:\n{self.tail()}")

    def port(self, timeout: float = 60.0) -> int:
        """Our frontend's HTTP port, from the line it prints once listening."""
        return int(self.wait_line(LISTENING, timeout).rsplit(":", 1)[1])

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])

    def write_log(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, f"{self.name}.log").write_text("\n".join(self.lines) + "\n")

    def stop(self) -> None:
        """SIGTERM, and SIGKILL after 15 s; idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)


def wait_model(url: str, timeout: float = 60.0) -> None:
    """Until the frontend at ``url`` lists a model in ``/v1/models``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                if json.loads(response.read())["data"]:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no model appeared in {url}/v1/models within {timeout:g} s")


_RECEIVER = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.otlp_receiver import OtlpReceiver
r = OtlpReceiver()
print(r.endpoint, flush=True)
sys.stdin.read()
print(len(r.spans), flush=True)
r.close()
"""


class OtlpReceiverProcess:
    """The tests' OTLP/HTTP receiver (``tests/otlp_receiver.py``) in a process of its own, so
    that its CPU is not the measured process's: ``endpoint`` once it listens, :meth:`spans`
    (how many it received; it stops then); ``with`` kills it on the way out."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RECEIVER, str(REPO)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.endpoint = self.proc.stdout.readline().strip()

    def spans(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        return int(self.proc.stdout.readline().strip() or 0)

    def __enter__(self) -> OtlpReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


TRACING_MODES = ("off", "local", "export")


def tracing_env(mode: str, endpoint: str) -> dict[str, str]:
    """The environment of issue 17's tracing ``mode``: ``off`` (``OTEL_SDK_DISABLED=true``: no
    spans at all), ``local`` (the default: spans with ids, nothing recorded) or ``export``
    (recorded and sent over OTLP http/protobuf to ``endpoint``)."""
    if mode == "off":
        return {"OTEL_SDK_DISABLED": "true"}
    if mode == "local":
        return {}
    if mode == "export":
        return {
            "OTEL_EXPORT_ENABLED": "1",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
        }
    raise SystemExit(f"unknown tracing mode {mode!r} (off, local, export)")


@contextmanager
def tracing_mode(mode: str) -> Iterator[None]:
    """This process (and the children it starts) in tracing ``mode`` (:func:`tracing_env`),
    set before anything sets tracing up. ``export`` starts an :class:`OtlpReceiverProcess`
    unless ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` already names one (a parent's: the runs
    under valgrind of ``cachegrind.per_request`` share their parent's receiver)."""
    for key in ("OTEL_SDK_DISABLED", "OTEL_EXPORT_ENABLED"):
        os.environ.pop(key, None)
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    if mode != "export" or endpoint:
        os.environ.update(tracing_env(mode, endpoint))
        yield
        return
    with OtlpReceiverProcess() as receiver:
        os.environ.update(tracing_env(mode, receiver.endpoint))
        try:
            yield
        finally:
            os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)

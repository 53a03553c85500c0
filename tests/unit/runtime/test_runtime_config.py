"""The TCP request plane's limits: a ``--tcp-*`` flag or its ``DYN_TCP_*`` twin, read once by the
config layer, reaches the server and the client the runtime builds."""

from __future__ import annotations

import argparse

import pytest

from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.request_plane.tcp_client import TCPRequestPlaneClient
from dynamo.runtime.request_plane.tcp_server import TCPRequestPlaneServer
from dynamo.runtime.runtime import DistributedRuntime

pytestmark = pytest.mark.unit

_ENVS = {
    "DYN_TCP_MAX_MESSAGE_SIZE": "1000",
    "DYN_TCP_MAX_INFLIGHT": "7",
    "DYN_TCP_MAX_CONNECTIONS": "5",
    "DYN_TCP_FRAME_TIMEOUT_SECS": "1.5",
}
_FLAGS = [
    "--tcp-max-message-size=1000",
    "--tcp-max-inflight=7",
    "--tcp-max-connections=5",
    "--tcp-frame-timeout-secs=1.5",
]


def _config(argv: list[str]) -> RuntimeConfig:
    parser = argparse.ArgumentParser()
    RuntimeConfig.add_arguments(parser)
    return RuntimeConfig.from_args(parser.parse_args(argv))


def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENVS:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    config = _config([])
    assert config == RuntimeConfig(discovery_dir=config.discovery_dir)
    assert (config.tcp_max_message_size, config.tcp_max_inflight) == (32 * 1024 * 1024, 16_384)
    assert (config.tcp_max_connections, config.tcp_frame_timeout_s) == (4_096, 30.0)
    server = TCPRequestPlaneServer()
    assert (server.max_frame_size, server.max_inflight) == (32 * 1024 * 1024, 16_384)
    assert (server.max_connections, server.frame_timeout_s) == (4_096, 30.0)


@pytest.mark.parametrize("source", ["flags", "env"])
def test_tcp_limits_reach_the_server_and_client(
    monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    _clear(monkeypatch)
    if source == "env":
        for name, value in _ENVS.items():
            monkeypatch.setenv(name, value)
    config = _config(_FLAGS if source == "flags" else [])
    assert (config.tcp_max_message_size, config.tcp_max_inflight) == (1000, 7)
    assert (config.tcp_max_connections, config.tcp_frame_timeout_s) == (5, 1.5)
    runtime = DistributedRuntime(config)
    server = runtime._make_server()  # noqa: SLF001 - what the runtime builds, not started
    assert isinstance(server, TCPRequestPlaneServer)
    assert (server.max_frame_size, server.max_inflight) == (1000, 7)
    assert (server.max_connections, server.frame_timeout_s) == (5, 1.5)
    client = runtime._make_transport()  # noqa: SLF001
    assert isinstance(client, TCPRequestPlaneClient) and client.max_frame_size == 1000


def test_bad_tcp_limits_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    with pytest.raises(ValueError, match="positive"):
        _config(["--tcp-max-message-size=-1"])
    with pytest.raises(ValueError, match="positive"):
        _config(["--tcp-frame-timeout-secs=0"])
    monkeypatch.setenv("DYN_TCP_MAX_INFLIGHT", "lots")
    with pytest.raises(ValueError, match="DYN_TCP_MAX_INFLIGHT"):
        _config([])

"""Runtime configuration and the one helper for CLI flags with ``DYN_*`` environment twins."""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from dynamo.runtime.codec import DEFAULT_MAX_FRAME_SIZE
from dynamo.runtime.request_plane.tcp_server import (
    DEFAULT_FRAME_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_INFLIGHT,
)

DISCOVERY_BACKENDS = ("memory", "file", "etcd")
REQUEST_PLANES = ("local", "tcp")
EVENT_PLANES = ("local", "zmq", "nats")
DEFAULT_ETCD_ENDPOINTS = "http://127.0.0.1:2379"
DEFAULT_NATS_SERVER = "nats://127.0.0.1:4222"


def env_name(flag: str) -> str:
    """``--router-mode`` -> ``DYN_ROUTER_MODE``."""
    return "DYN_" + flag.lstrip("-").replace("-", "_").upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def add_flag(
    parser: argparse.ArgumentParser | Any,
    flag: str,
    *,
    default: Any = None,
    type: Any = str,  # noqa: A002 - mirrors argparse
    help: str = "",  # noqa: A002
    choices: Any = None,
    env: str | None = None,
    **kwargs: Any,
) -> None:
    """Add ``flag`` whose default comes from its environment twin (``DYN_<FLAG>``) if set.

    ``type=bool`` makes a ``--flag`` / ``--no-flag`` pair.
    """
    env = env or env_name(flag)
    raw = os.environ.get(env)
    try:
        value = default if raw is None else (_parse_bool(raw) if type is bool else type(raw))
    except ValueError as exc:  # name the variable: the traceback would not
        raise ValueError(f"{env}={raw!r}: {exc}") from None
    if type is bool:
        parser.add_argument(
            flag,
            default=value,
            action=argparse.BooleanOptionalAction,
            help=f"{help} [env {env}; default {default}]",
            **kwargs,
        )
        return
    parser.add_argument(
        flag,
        default=value,
        type=type,
        choices=choices,
        help=f"{help} [env {env}; default {default}]",
        **kwargs,
    )


def default_file_discovery_dir() -> str:
    return os.environ.get("DYN_FILE_KV") or os.path.join(tempfile.gettempdir(), "dynamo_store_kv")


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How a process joins the system. Chosen once, in ``runtime/runtime.py``."""

    namespace: str = "dynamo"
    discovery_backend: str = "file"
    discovery_dir: str = field(default_factory=default_file_discovery_dir)
    request_plane: str = "tcp"
    event_plane: str = "zmq"
    host: str = "127.0.0.1"
    # The address published in discovery for others to reach this process's servers; empty:
    # the bind address (``host``), which must then be routable (not 0.0.0.0).
    advertise_host: str = ""
    lease_ttl: float = 10.0
    etcd_endpoints: tuple[str, ...] = (DEFAULT_ETCD_ENDPOINTS,)
    nats_server: str = DEFAULT_NATS_SERVER
    # The TCP request plane's limits (both its server and its client): the largest frame, the
    # handlers running at once, the connections served, and how long a frame may take to arrive.
    tcp_max_message_size: int = DEFAULT_MAX_FRAME_SIZE
    tcp_max_inflight: int = DEFAULT_MAX_INFLIGHT
    tcp_max_connections: int = DEFAULT_MAX_CONNECTIONS
    tcp_frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.discovery_backend not in DISCOVERY_BACKENDS:
            raise ValueError(f"discovery backend must be one of {DISCOVERY_BACKENDS}")
        if self.request_plane not in REQUEST_PLANES:
            raise ValueError(f"request plane must be one of {REQUEST_PLANES}")
        if self.event_plane not in EVENT_PLANES:
            raise ValueError(f"event plane must be one of {EVENT_PLANES}")
        if self.lease_ttl <= 0:
            raise ValueError("lease TTL must be positive")
        if not self.etcd_endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if min(self.tcp_max_message_size, self.tcp_max_inflight, self.tcp_max_connections) <= 0:
            raise ValueError("TCP message size, in-flight and connection limits must be positive")
        if self.tcp_frame_timeout_s <= 0:
            raise ValueError("TCP frame timeout must be positive")

    @property
    def published_host(self) -> str:
        """The host other processes use to reach this one's servers."""
        return self.advertise_host or self.host

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        d = RuntimeConfig()
        g = parser.add_argument_group("runtime")
        add_flag(g, "--namespace", default=d.namespace, help="dynamo namespace")
        add_flag(
            g,
            "--discovery-backend",
            default=d.discovery_backend,
            choices=DISCOVERY_BACKENDS,
            help="where instances and models are registered",
        )
        add_flag(
            g,
            "--discovery-dir",
            default=d.discovery_dir,
            env="DYN_FILE_KV",
            help="directory of the file discovery backend",
        )
        add_flag(
            g,
            "--request-plane",
            default=d.request_plane,
            choices=REQUEST_PLANES,
            help="request transport",
        )
        add_flag(
            g, "--event-plane", default=d.event_plane, choices=EVENT_PLANES, help="event transport"
        )
        add_flag(
            g,
            "--runtime-host",
            default=d.host,
            env="DYN_RUNTIME_HOST",
            help="address the request and event planes bind",
        )
        add_flag(
            g,
            "--runtime-advertise-host",
            default=d.advertise_host,
            env="DYN_RUNTIME_ADVERTISE_HOST",
            help="address published in discovery for the request and event planes "
            "(empty: the bind address)",
        )
        add_flag(
            g,
            "--etcd-endpoints",
            default=",".join(d.etcd_endpoints),
            env="ETCD_ENDPOINTS",
            help="comma-separated etcd client URLs (discovery backend etcd)",
        )
        add_flag(
            g,
            "--nats-server",
            default=d.nats_server,
            env="NATS_SERVER",
            help="NATS server URL(s), comma-separated (event plane nats)",
        )
        add_flag(
            g, "--lease-ttl", default=d.lease_ttl, type=float, help="discovery lease TTL in seconds"
        )
        add_flag(
            g,
            "--tcp-max-message-size",
            default=d.tcp_max_message_size,
            type=int,
            help="largest TCP request-plane frame (header + body) in bytes",
        )
        add_flag(
            g,
            "--tcp-max-inflight",
            default=d.tcp_max_inflight,
            type=int,
            help="request handlers the TCP request-plane server runs at once (more: Overloaded)",
        )
        add_flag(
            g,
            "--tcp-max-connections",
            default=d.tcp_max_connections,
            type=int,
            help="connections the TCP request-plane server accepts (more: Overloaded, closed)",
        )
        add_flag(
            g,
            "--tcp-frame-timeout-secs",
            default=d.tcp_frame_timeout_s,
            type=float,
            help="seconds a TCP request-plane frame may take to arrive before the connection "
            "is closed",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RuntimeConfig:
        return cls(
            namespace=args.namespace,
            discovery_backend=args.discovery_backend,
            discovery_dir=args.discovery_dir,
            request_plane=args.request_plane,
            event_plane=args.event_plane,
            host=args.runtime_host,
            advertise_host=args.runtime_advertise_host,
            lease_ttl=args.lease_ttl,
            etcd_endpoints=tuple(e.strip() for e in args.etcd_endpoints.split(",") if e.strip()),
            nats_server=args.nats_server,
            tcp_max_message_size=args.tcp_max_message_size,
            tcp_max_inflight=args.tcp_max_inflight,
            tcp_max_connections=args.tcp_max_connections,
            tcp_frame_timeout_s=args.tcp_frame_timeout_secs,
        )

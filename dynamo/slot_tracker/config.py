"""Configuration of the standalone slot tracker: flags (with DYN_* twins) -> a frozen config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from dynamo.router.sequences import DEFAULT_EXPIRY_S
from dynamo.runtime.config import add_flag
from dynamo.runtime.http_json import DEFAULT_MAX_BODY_BYTES
from dynamo.runtime.http_limits import HttpLimits
from dynamo.slot_tracker.replica import DEFAULT_QUEUE_SIZE, validate_endpoint


@dataclass(frozen=True, slots=True)
class SlotTrackerConfig:
    host: str = "0.0.0.0"
    port: int = 8091
    replica_sync_bind: str | None = None
    replica_sync_advertise: str | None = None
    replica_sync_peers: tuple[str, ...] = ()
    active_request_expiry_s: float = DEFAULT_EXPIRY_S
    replica_queue_size: int = DEFAULT_QUEUE_SIZE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    busy_poll_us: int = 200
    limits: HttpLimits = field(default_factory=HttpLimits)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.replica_sync_bind is None:
            if self.replica_sync_advertise is not None or self.replica_sync_peers:
                raise ValueError(
                    "--replica-sync-advertise and --replica-sync-peers require --replica-sync-bind"
                )
        else:
            validate_endpoint(self.replica_sync_bind, bind=True)
            if self.replica_sync_advertise is not None:
                validate_endpoint(self.replica_sync_advertise)
            for peer in self.replica_sync_peers:
                validate_endpoint(peer)
        if self.active_request_expiry_s <= 0:
            raise ValueError("active request expiry must be positive")
        if self.replica_queue_size <= 0 or self.max_body_bytes <= 0:
            raise ValueError("queue size and body limit must be positive")
        if not 0 <= self.busy_poll_us <= 1_000_000:
            raise ValueError(f"busy poll must be in 0..1000000 us, got {self.busy_poll_us}")


def _peers(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SlotTrackerConfig()
    add_flag(
        parser, "--host", default=d.host, env="DYN_SLOT_TRACKER_HOST", help="HTTP listen address"
    )
    add_flag(
        parser,
        "--port",
        default=d.port,
        type=int,
        env="DYN_SLOT_TRACKER_PORT",
        help="HTTP port (0 picks a free one; the bound port is printed)",
    )
    add_flag(
        parser,
        "--replica-sync-bind",
        default=None,
        help="ZMQ PUB endpoint to bind, enables replica sync",
    )
    add_flag(
        parser,
        "--replica-sync-advertise",
        default=None,
        help="reachable form of the bind endpoint; never subscribed to",
    )
    add_flag(
        parser,
        "--replica-sync-peers",
        default="",
        help="comma-separated peer PUB endpoints to subscribe to",
    )
    add_flag(
        parser,
        "--active-request-expiry-secs",
        default=d.active_request_expiry_s,
        type=float,
        env="DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS",
        help="requests older than this are freed as stale",
    )
    add_flag(
        parser,
        "--replica-queue-size",
        default=d.replica_queue_size,
        type=int,
        help="outbound replica events held before new ones are dropped",
    )
    add_flag(
        parser,
        "--busy-poll-us",
        default=d.busy_poll_us,
        type=int,
        env="DYN_SLOT_TRACKER_BUSY_POLL_US",
        help="under load (10k+ req/s), keep polling this long after answering instead of "
        "sleeping: lower latency, more CPU; 0 disables",
    )
    HttpLimits.add_arguments(parser)


def from_args(args: argparse.Namespace) -> SlotTrackerConfig:
    return SlotTrackerConfig(
        host=args.host,
        port=args.port,
        replica_sync_bind=args.replica_sync_bind or None,
        replica_sync_advertise=args.replica_sync_advertise or None,
        replica_sync_peers=_peers(args.replica_sync_peers or ""),
        active_request_expiry_s=args.active_request_expiry_secs,
        replica_queue_size=args.replica_queue_size,
        busy_poll_us=args.busy_poll_us,
        limits=HttpLimits.from_args(args),
    )

"""Limits every HTTP server of ours enforces against hostile or broken clients.

One frozen dataclass, shared by every ``runtime/http_server.py`` server: the frontend's, the slot
tracker's and the workers' status servers. Each limit is a flag with a ``DYN_HTTP_*`` twin; the
defaults are ones a normal client never meets and a hostile one cannot exhaust the process with:

- ``max_connections``: open client connections; one more is answered 503 and closed (the
  frontend's answer has an OpenAI error body and ``Retry-After``).
- ``header_timeout_s``: from a request's first byte to the end of its headers (slowloris).
- ``body_timeout_s``: from the end of the headers to the end of the body (a client that declares
  a length and sends less, or never ends a chunked body): 408 and the connection is closed.
- ``keep_alive_timeout_s``: an idle connection between requests is closed.
- ``max_header_bytes``: request line + headers.
"""

from __future__ import annotations

import argparse
import resource
from dataclasses import dataclass

from dynamo.runtime.config import add_flag


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_connections: int = 4096
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max connections must be at least 1")
        if self.max_header_bytes < 1024:
            raise ValueError("max header bytes must be at least 1024")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        d = HttpLimits()
        add_flag(
            parser,
            "--http-max-connections",
            default=d.max_connections,
            type=int,
            help="open HTTP connections; more are refused",
        )
        add_flag(
            parser,
            "--http-header-timeout-secs",
            default=d.header_timeout_s,
            type=float,
            help="time a client has to send a request's headers",
        )
        add_flag(
            parser,
            "--http-body-timeout-secs",
            default=d.body_timeout_s,
            type=float,
            help="time a client has to send a request's body after its headers (408 after)",
        )
        add_flag(
            parser,
            "--http-keep-alive-timeout-secs",
            default=d.keep_alive_timeout_s,
            type=float,
            help="an idle keep-alive connection is closed after this long",
        )
        add_flag(
            parser,
            "--http-max-header-bytes",
            default=d.max_header_bytes,
            type=int,
            help="largest request line + headers",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpLimits:
        return cls(
            max_connections=args.http_max_connections,
            header_timeout_s=args.http_header_timeout_secs,
            body_timeout_s=args.http_body_timeout_secs,
            keep_alive_timeout_s=args.http_keep_alive_timeout_secs,
            max_header_bytes=args.http_max_header_bytes,
        )

    @classmethod
    def from_env(cls) -> HttpLimits:
        """The limits from the ``DYN_HTTP_*`` variables alone (servers without flags)."""
        parser = argparse.ArgumentParser(add_help=False)
        cls.add_arguments(parser)
        return cls.from_args(parser.parse_args([]))


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's soft open-file limit towards ``wanted`` (capped by the hard limit),
    so that a connection limit, not EMFILE, is what a flood of sockets meets. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft)

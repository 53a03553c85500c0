"""The one logging setup of every dynamo process (frontend, workers, slot tracker, ``serve``).

Levels come from a filter string read the way the reference reads ``DYN_LOG``: comma-separated
directives, a bare level sets the default and ``target=level`` sets one module subtree
(``DYN_LOG=info,dynamo.router=debug``; Rust-style ``dynamo::router`` is accepted too). The
``--log-level`` flag of every process takes the same string and has ``DYN_LOG`` as its env twin.

``DYN_LOGGING_JSONL=1`` writes one JSON object per line with ``time``, ``level``, ``target``,
``message``, ``trace_id`` and ``span_id`` (the ids of the OpenTelemetry span current when the
record was made, so a request's log lines can be found by its trace id), plus ``file``,
``line`` and, for exceptions, ``exception``. Otherwise lines are human-readable text.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import sys
from typing import Any

from opentelemetry import trace

LOG_ENV = "DYN_LOG"
JSONL_ENV = "DYN_LOGGING_JSONL"
TRACE = 5
"""The reference's ``trace`` level, below ``debug``."""

_LEVELS = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "off": logging.CRITICAL + 10,
}
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_TRUE = {"1", "true", "yes", "on"}
logging.addLevelName(TRACE, "TRACE")


def _level(name: str) -> int:
    try:
        return _LEVELS[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown log level {name.strip()!r} (one of {', '.join(_LEVELS)})"
        ) from None


def parse_filter(spec: str) -> tuple[int, dict[str, int]]:
    """``"info,dynamo.router=debug"`` -> ``(INFO, {"dynamo.router": DEBUG})``.

    The last bare level wins; an empty string means ``info``. Raises ``ValueError`` on an unknown
    level or an empty target."""
    default = logging.INFO
    targets: dict[str, int] = {}
    for raw in spec.split(","):
        directive = raw.strip()
        if not directive:
            continue
        if "=" in directive:
            target, _, level = directive.partition("=")
            target = target.strip().replace("::", ".")
            if not target:
                raise ValueError(f"log directive {directive!r} has no target")
            targets[target] = _level(level)
        else:
            default = _level(directive)
    return default, targets


def _current_ids() -> tuple[str | None, str | None]:
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None, None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


class JsonlFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring for the keys)."""

    def format(self, record: logging.LogRecord) -> str:
        trace_id, span_id = _current_ids()
        when = _dt.datetime.fromtimestamp(record.created, tz=_dt.UTC)
        line: dict[str, Any] = {
            "time": when.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "level": "WARN" if record.levelno == logging.WARNING else record.levelname,
            "target": record.name,
            "message": record.getMessage(),
            "trace_id": trace_id,
            "span_id": span_id,
            "file": record.pathname,
            "line": record.lineno,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def jsonl_enabled() -> bool:
    return os.environ.get(JSONL_ENV, "").strip().lower() in _TRUE


def configure_logging(spec: str | None = None) -> None:
    """Install the process's one stderr handler and apply the level filter.

    ``spec`` is a ``DYN_LOG``-style string (``None``: read ``DYN_LOG``, default ``info``).
    Calling it again replaces the previous setup (tests, ``dynamo serve --in-process``)."""
    default, targets = parse_filter(spec if spec is not None else os.environ.get(LOG_ENV, "info"))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonlFormatter() if jsonl_enabled() else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_dynamo_handler", False):
            root.removeHandler(old)
    handler._dynamo_handler = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(default)
    for target, level in targets.items():
        logging.getLogger(target).setLevel(level)


def add_log_flag(parser: argparse.ArgumentParser | Any) -> None:
    """``--log-level``: a ``DYN_LOG``-style filter string, defaulting to ``$DYN_LOG`` or info."""
    parser.add_argument(
        "--log-level",
        default=os.environ.get(LOG_ENV, "info"),
        help="log filter, e.g. 'info' or 'info,dynamo.router=debug' [env DYN_LOG; default info]",
    )

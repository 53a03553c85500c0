"""The one logging setup: DYN_LOG filters, JSONL lines carrying the current span's ids."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from dynamo.observability import logging as dlog


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    touched = ["dynamo.router", "dynamo.runtime.client", "dynamo.frontend"]
    levels = {name: logging.getLogger(name).level for name in touched}
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    for name, lvl in levels.items():
        logging.getLogger(name).setLevel(lvl)


def test_parse_filter_reads_reference_directives() -> None:
    assert dlog.parse_filter("info,dynamo.router=debug") == (
        logging.INFO,
        {"dynamo.router": logging.DEBUG},
    )
    assert dlog.parse_filter("warn, dynamo::runtime::client=trace ,") == (
        logging.WARNING,
        {"dynamo.runtime.client": dlog.TRACE},
    )
    assert dlog.parse_filter("") == (logging.INFO, {})
    assert dlog.parse_filter("DEBUG")[0] == logging.DEBUG
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        dlog.parse_filter("loud")
    with pytest.raises(ValueError, match="no target"):
        dlog.parse_filter("=debug")


def test_configure_applies_levels_and_replaces_its_handler(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DYN_LOGGING_JSONL", raising=False)
    dlog.configure_logging("warn,dynamo.router=debug")
    dlog.configure_logging("warn,dynamo.router=debug")
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_dynamo_handler", False)]
    assert len(ours) == 1
    assert logging.getLogger().level == logging.WARNING
    assert logging.getLogger("dynamo.router.kv_router").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("dynamo.frontend").isEnabledFor(logging.INFO)


def test_jsonl_line_carries_the_current_span() -> None:
    tracer = TracerProvider().get_tracer("test")
    formatter = dlog.JsonlFormatter()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.getLogger("dynamo.test_jsonl")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        logger.warning("outside %d", 1)
        with tracer.start_as_current_span("req") as span:
            logger.info("inside")
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                logger.exception("failed")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    lines = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    assert [x["message"] for x in lines] == ["outside 1", "inside", "failed"]
    outside, inside, failed = lines
    assert outside["level"] == "WARN" and outside["trace_id"] is None
    assert outside["target"] == "dynamo.test_jsonl" and outside["time"].endswith("Z")
    ctx = span.get_span_context()
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert inside["level"] == "INFO"
    assert "RuntimeError: boom" in failed["exception"]


def test_log_flag_defaults_to_dyn_log(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    monkeypatch.setenv("DYN_LOG", "error,dynamo=debug")
    parser = argparse.ArgumentParser()
    dlog.add_log_flag(parser)
    assert parser.parse_args([]).log_level == "error,dynamo=debug"
    assert parser.parse_args(["--log-level", "debug"]).log_level == "debug"

"""Suite-wide settings: hypothesis without per-example deadlines (CI machines are slow and
shared; correctness, not speed, is what property tests check here)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.spans import SpanCapture, span_capture

settings.register_profile(
    "dynamo", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("dynamo")
pytest_plugins = ["tests.servers"]


@pytest.fixture
def spans() -> Iterator[SpanCapture]:
    """The spans this test ends (in this process), collected in memory."""
    capture = span_capture()
    capture.spans.clear()
    capture.active = True
    yield capture
    capture.active = False
    capture.spans.clear()

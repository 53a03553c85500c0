"""Suite-wide settings: hypothesis without per-example deadlines (CI machines are slow and
shared; correctness, not speed, is what property tests check here)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "dynamo", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("dynamo")
pytest_plugins = ["tests.servers"]

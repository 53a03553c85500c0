"""dynamo/native.py: one choice per process between the C extensions and their fallbacks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from dynamo import native

_REPORT = """
import json, sys
import dynamo.runtime.http_server  # a server module: must not pull the sender in by itself
lazy = "dynamo.runtime.sender" not in sys.modules and "dynamo.runtime._sender" not in sys.modules
from dynamo.router.block_counts import IMPLEMENTATION as blocks
from dynamo.runtime.sender import IMPLEMENTATION as sender
print(json.dumps([blocks, sender, lazy]))
"""


def report(env_value: str | None) -> list[object]:
    env = {k: v for k, v in os.environ.items() if k != native.ENV}
    if env_value is not None:
        env[native.ENV] = env_value
    out = subprocess.run(
        [sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True, check=True
    )
    result: list[object] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_dyn_native_off_forces_both_fallbacks(value: str) -> None:
    fallbacks = ["dynamo.router._blocks_fallback", "dynamo.runtime._sender_fallback", True]
    assert report(value) == fallbacks


def test_native_modules_are_used_when_built() -> None:
    pytest.importorskip("dynamo.router._blocks")
    pytest.importorskip("dynamo.runtime._sender")
    natives = ["dynamo.router._blocks", "dynamo.runtime._sender", True]
    assert report(None) == natives and report("1") == natives


def test_a_native_module_that_is_not_built_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    if not native.WANTED:
        pytest.skip("DYN_NATIVE=0: the native module is never tried")
    with caplog.at_level(logging.WARNING, logger="dynamo.native"):
        module = native.load("dynamo.router._not_built", "dynamo.router._blocks_fallback")
    assert module.__name__ == "dynamo.router._blocks_fallback"
    assert "dynamo.router._not_built is not available" in caplog.text


def test_a_stale_native_build_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    """A native module built from an older source (without a name the contract now has)."""
    if not native.WANTED:
        pytest.skip("DYN_NATIVE=0: the native module is never tried")
    with caplog.at_level(logging.WARNING, logger="dynamo.native"):
        module = native.load(
            "dynamo.router._blocks_fallback", "dynamo.router._hash_fallback", requires=("nope",)
        )
    assert module.__name__ == "dynamo.router._hash_fallback"
    assert "stale build" in caplog.text

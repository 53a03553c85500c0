"""The replay's summary is the same whichever implementations run it: natively (the records
read by ``bench/_stats.c``) and with ``DYN_NATIVE=0`` (every pure-Python twin), compared as
JSON bytes (every float bit for bit)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import msgspec

from dynamo import native
from dynamo.bench.config import BenchConfig
from dynamo.mocker.config import MockerConfig
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import run_replay

_VOLATILE = ("date", "replay")  # the run's date and wall-clock figures

_CHILD = """
import sys
from tests.unit.replay.test_replay_summary import summary_bytes
sys.stdout.buffer.write(summary_bytes())
"""


def summary_bytes() -> bytes:
    """The summary of a 320-request KV-routed replay (4,800 gaps: past the native module's
    4,096 for counting the ITLs by value), its volatile figures left out."""
    bench = BenchConfig(
        url="replay:",
        workload="prefix",
        prefix_groups=4,
        prefix_len=128,
        suffix_len=32,
        osl=16,
        concurrency=16,
        num_requests=320,
        seed=5,
    )
    engine = MockerConfig(num_gpu_blocks=256, block_size=16)
    result = run_replay(bench, Deployment(2, "kv", engine=engine))
    summary: dict[str, Any] = result.summary
    return msgspec.json.encode({k: v for k, v in summary.items() if k not in _VOLATILE})


def test_summary_native_and_twins_are_the_same_bytes() -> None:
    here = summary_bytes()
    other = "0" if native.WANTED else "1"  # this process runs one way, the child the other
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        timeout=120,
        check=False,
        env=os.environ | {"DYN_NATIVE": other},
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert child.stdout == here
    assert b'"itl_ms":{"count":4800' in here

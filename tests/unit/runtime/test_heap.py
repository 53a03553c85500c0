"""settle_after_start freezes the start-up heap and raises the young-generation threshold
(in a child process: it changes process-wide state)."""

from __future__ import annotations

import subprocess
import sys

from dynamo.runtime.heap import YOUNG_THRESHOLD


def test_settle_after_start_in_a_fresh_process() -> None:
    code = (
        "import gc\n"
        "from dynamo.runtime.heap import settle_after_start\n"
        "before = gc.get_threshold()\n"
        "settle_after_start()\n"
        "after = gc.get_threshold()\n"
        "print(before[1:] == after[1:], after[0], gc.get_freeze_count() > 1000)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == ["True", str(YOUNG_THRESHOLD), "True"]

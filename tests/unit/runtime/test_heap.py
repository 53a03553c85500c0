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


def test_the_batch_commands_settle_their_process() -> None:
    """``dynamo replay`` (through the console script's dispatcher) runs with the service
    settings; calling its ``main`` in-process (tests) leaves the caller's collector alone."""
    code = (
        "import contextlib, gc, io\n"
        "from dynamo import cli\n"
        "from dynamo.replay.__main__ import main\n"
        "args = ['--workers', '1', '--num-requests', '2', '--isl', '32', '--osl', '2']\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(args) == 0\n"
        "print(gc.get_threshold()[0], gc.get_freeze_count())\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert cli.main(['replay', *args]) == 0\n"
        "print(gc.get_threshold()[0], gc.get_freeze_count() > 1000)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert out == ["700", "0", str(YOUNG_THRESHOLD), "True"]

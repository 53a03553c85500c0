"""Instructions a unit of work, counted by valgrind's cachegrind: the A/B figure a shared VM's
load cannot move (two runs of one tree agree within ~0.7 %).

``per_request(module, requests, args)`` runs ``python -m <module> --requests N <args>`` under
cachegrind for N = ``requests`` and ``2 * requests`` and returns the difference in instructions
divided by ``requests``: the interpreter's start-up and imports cancel out.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def per_request(module: str, requests: int, args: list[str], *, echo: bool = False) -> float:
    """Instructions a request of ``module``'s run (see the module docstring). ``echo`` prints
    each run's own output to stderr."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind")
    counts = []
    for n in (requests, 2 * requests):
        cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
        cmd += [sys.executable, "-m", module, "--requests", str(n), *args]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the run under valgrind failed:\n{done.stderr[-3000:]}")
        found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
        if found is None:
            raise SystemExit(f"no instruction count in valgrind's output:\n{done.stderr[-2000:]}")
        counts.append(int(found.group(1).replace(",", "")))
        if echo:
            print(done.stdout.strip().replace("best of 1 x", "under cachegrind,"), file=sys.stderr)
    return (counts[1] - counts[0]) / requests

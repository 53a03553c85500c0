"""CPU time of server processes, read from ``/proc`` (Linux).

A process's ``utime + stime`` in ``/proc/PID/stat`` already sums all of its threads. A given
PID also covers its live descendants (``dynamo serve`` or a multi-process HTTP server), found
through the ``ppid`` field of every ``/proc/*/stat``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

_PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return text[text.rfind(")") + 2 :].split()


def process_cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of ``pid`` (all threads), None if it does not exist."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return ticks / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> set[int]:
    """The live processes below ``pid`` (children, grandchildren, ...)."""
    parent_of: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                parent_of[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier}
        frontier -= found
        found |= frontier
    return found


@dataclass(slots=True)
class CpuMeter:
    """Measures the CPU seconds that the process trees of ``pids`` use between ``start()``
    and ``stop()``. Processes that appear during the run are counted from their birth when
    they are seen at ``stop()``; processes that end during the run lose their last ticks."""

    pids: list[int]
    _start: dict[int, float] = field(default_factory=dict)
    _trees: dict[int, set[int]] = field(default_factory=dict)

    def check(self) -> None:
        """Raises ValueError for a PID that does not exist (or /proc is missing)."""
        for pid in self.pids:
            if process_cpu_seconds(pid) is None:
                raise ValueError(f"no process with PID {pid} (or no /proc on this system)")

    def start(self) -> None:
        self._start.clear()
        for pid in self.pids:
            tree = {pid} | descendants(pid)
            self._trees[pid] = tree
            for member in tree:
                seconds = process_cpu_seconds(member)
                if seconds is not None:
                    self._start[member] = seconds

    def stop(self) -> dict[int, float]:
        """CPU seconds per given PID (its tree) since ``start()``."""
        used: dict[int, float] = {}
        for pid in self.pids:
            tree = self._trees.get(pid, {pid}) | descendants(pid) | {pid}
            total = 0.0
            for member in tree:
                seconds = process_cpu_seconds(member)
                if seconds is not None:
                    total += seconds - self._start.get(member, 0.0)
            used[pid] = total
        return used

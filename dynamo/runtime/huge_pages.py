"""Back a worker's long-lived heap with transparent huge pages (Linux), so its death is cheap.

A killed process closes its sockets last: the kernel tears down its memory first (``do_exit``
runs ``exit_mm`` before ``exit_files``), and freeing anonymous memory in 4 KiB pages costs about
0.4 ms per MiB on the 2-core VM (a SIGKILLed mocker, 38 MiB anonymous: ~11 ms at a quiet
moment, 20-45 ms under load, against ~1.5 ms for a bare interpreter). Until then its peers see
nothing: a frontend detects the death, and migrates the streams, only when the sockets close.
The same memory in 2 MiB pages is freed several times faster (an interpreter with the worker's
imports: 21 -> 13 ms median when half of it is collapsed; 64 MiB touched: 39 -> 5 ms).

So once start-up is done, every private anonymous region of 2 MiB or more is marked
``MADV_HUGEPAGE`` (later faults there, e.g. the ``[heap]`` growing, get huge pages when the
system's THP mode is ``madvise``) and its 2 MiB-aligned part is collapsed now (``MADV_COLLAPSE``,
Linux 6.1+; it copies the pages once: a few ms for a mocker). Best effort: where the kernel or
the system refuses (no THP, an older kernel, not Linux), nothing changes. The cost: a region's
untouched 4 KiB holes inside a collapsed 2 MiB page become resident (the mocker's anonymous
memory grows by ~1-2 MiB).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
COLLAPSE_LIMIT = 128 << 20
"""At most this much is collapsed (copied) at start; a larger heap is only marked."""


def _madvise() -> ctypes._FuncPointer | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn: ctypes._FuncPointer = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def anonymous_regions(maps: str) -> list[tuple[int, int]]:
    """(start, end) of each private, writable, anonymous region (``[heap]`` included) of
    2 MiB or more in a ``/proc/<pid>/maps`` text."""
    out = []
    for line in maps.splitlines():
        parts = line.split()
        if len(parts) < 5 or parts[1] != "rw-p":
            continue
        if len(parts) > 5 and parts[5] != "[heap]":
            continue  # a file mapping, a stack, [vvar]...
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if end - start >= HUGE_PAGE:
            out.append((start, end))
    return out


def back_heap_with_huge_pages(limit: int = COLLAPSE_LIMIT) -> int:
    """Mark the process's large anonymous regions for huge pages and collapse up to ``limit``
    bytes of them now. Returns the bytes collapsed (0 where unsupported). Process-wide: call
    it from a worker's entry point once start-up is done."""
    madvise = _madvise()
    if madvise is None:
        return 0
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return 0
    collapsed = 0
    for start, end in anonymous_regions(maps):
        madvise(start, end - start, MADV_HUGEPAGE)
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        hi = end // HUGE_PAGE * HUGE_PAGE
        if hi > lo and collapsed + (hi - lo) <= limit and madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            collapsed += hi - lo
    log.debug("huge pages: %d MiB of the heap collapsed", collapsed >> 20)
    return collapsed

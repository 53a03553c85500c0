"""back_heap_with_huge_pages: which regions it takes from /proc/<pid>/maps, and (in a child
process: it changes process-wide state) that a large anonymous region ends up in huge pages
where the kernel allows them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dynamo.runtime.huge_pages import anonymous_regions

MAPS = """\
55ae4ab88000-55ae4b741000 rw-p 00000000 00:00 0                          [heap]
7efcadc00000-7efcae000000 rw-p 00000000 00:00 0
7efcae000000-7efcae100000 rw-p 00000000 00:00 0
7efcae553000-7efcae83e000 r--p 00000000 00:00 0
7f7336444000-7f7336978000 rw-p 00443000 fe:00 26933                      /usr/lib/libpython3.11.so
7fff6e384000-7fff6e5a5000 rw-p 00000000 00:00 0                          [stack]
"""


def test_only_large_private_writable_anonymous_regions() -> None:
    assert anonymous_regions(MAPS) == [
        (0x55AE4AB88000, 0x55AE4B741000),  # the [heap]
        (0x7EFCADC00000, 0x7EFCAE000000),  # 4 MiB anonymous; the 1 MiB one is too small
    ]


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "never"


@pytest.mark.skipif(_thp_mode() == "never", reason="no transparent huge pages here")
def test_a_touched_region_is_collapsed_in_a_fresh_process() -> None:
    code = (
        "import mmap\n"
        "from dynamo.runtime.huge_pages import back_heap_with_huge_pages\n"
        "m = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        "for i in range(0, len(m), 4096): m[i] = 1\n"
        "free = sum(sum(map(int, l.split()[4 + 9:])) for l in open('/proc/buddyinfo'))\n"
        "done = back_heap_with_huge_pages()\n"
        "huge = [l for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')]\n"
        "print(done >> 20, int(huge[0].split()[1]) >> 10, free)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    collapsed, huge, free_huge = int(out[0]), int(out[1]), int(out[2])
    if collapsed == 0:
        pytest.skip("the kernel refused MADV_COLLAPSE (before Linux 6.1?)")
    if collapsed < 14 and free_huge < 16:
        # memory too fragmented for the region's 2 MiB pages: the kernel collapses what it can
        pytest.skip(f"only {free_huge} free 2 MiB blocks: memory fragmented, not our code")
    assert collapsed >= 14 and huge >= 14  # the 16 MiB region's aligned part, at least

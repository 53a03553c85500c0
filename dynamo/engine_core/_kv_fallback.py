"""Pure-Python twin of ``dynamo.engine_core._kv`` (contract: ``_kv.pyi``), used where the
extension is not built or ``DYN_NATIVE=0``. Import through ``dynamo.engine_core.kv_kernels``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def cached_prefix(
    active: dict[int, int], inactive: OrderedDict[int, None], hashes: Sequence[int]
) -> int:
    n = 0
    for h in hashes:
        if h not in active and h not in inactive:
            break
        n += 1
    return n


def count_missing(active: dict[int, int], hashes: Sequence[int]) -> int:
    return sum(1 for h in hashes if h not in active)


def pin(
    active: dict[int, int], inactive: OrderedDict[int, None], hashes: Sequence[int]
) -> list[int]:
    absent: list[int] = []
    for i, h in enumerate(hashes):
        if h in active:
            active[h] += 1
        elif h in inactive:
            del inactive[h]
            active[h] = 1
        else:
            absent.append(i)
    return absent


def release_full(
    active: dict[int, int], inactive: OrderedDict[int, None], hashes: Sequence[int]
) -> None:
    for h in reversed(hashes):
        rc = active[h] - 1
        if rc:
            active[h] = rc
        else:
            del active[h]
            inactive[h] = None


def evict(
    inactive: OrderedDict[int, None],
    slots: dict[int, int],
    locals_: dict[int, int],
    silent: set[int],
    free_slots: list[int],
    n: int,
) -> list[int]:
    evicted: list[int] = []
    for _ in range(n):
        h, _ = inactive.popitem(last=False)
        free_slots.append(slots.pop(h))
        del locals_[h]
        if h in silent:
            silent.discard(h)
        else:
            evicted.append(h)
    return evicted

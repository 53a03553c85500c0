"""Pure-Python twin of ``dynamo.bench._stats`` (the contract: ``_stats.pyi``): the report's
order statistics of one series, by their definition (``sorted`` and ``sum`` of the scaled
values). Import through ``dynamo.bench.report``."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from itertools import chain, repeat

Figures = tuple[
    int, float | None, float | None, float | None, float | None, float | None, float | None
]


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of sorted values, linear interpolation."""
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def figures(values: list[float], scale: float) -> Figures | None:
    """``(count, mean, min, p50, p90, p99, max)`` of ``values`` times ``scale``: the values
    scaled, sorted, their mean the built-in ``sum`` of the sorted values over the count; all
    None but the count when there are no values. Never None (the native module's "cannot
    guarantee the same figures" answer)."""
    ordered = list(map(operator.mul, values, repeat(scale)))
    ordered.sort()
    if not ordered:
        return (0, None, None, None, None, None, None)
    return (
        len(ordered),
        sum(ordered) / len(ordered),
        ordered[0],
        percentile(ordered, 50),
        percentile(ordered, 90),
        percentile(ordered, 99),
        ordered[-1],
    )


def figures_joined(lists: list[list[float]], scale: float) -> Figures | None:
    """``figures`` of the lists' items, in order (a series kept per request, as the ITLs)."""
    return figures(list(chain.from_iterable(lists)), scale)

"""Pure-Python twin of ``dynamo.bench._stats`` (the contract: ``_stats.pyi``): the report's
order statistics of one series, by their definition (``sorted`` and ``sum`` of the scaled
values), and what the summary reads of a run's records. Import through
``dynamo.bench.report``."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from typing import Any

Figures = tuple[
    int, float | None, float | None, float | None, float | None, float | None, float | None
]
RecordFigures = tuple[
    int, list[Any], Figures, Figures, Figures, Figures, Figures, Figures, int, int, int, int
]
"""``record_figures``: completed, the failed records, the figures of ttft, itl, tpot and e2e
(ms), input and output tokens, then the output, prompt and cached token totals and the count
of prompts whose size differs from the expected."""


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
    return _figures(values, scale)


def _figures(values: Iterable[float], scale: float) -> Figures:
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
    return _figures(chain.from_iterable(lists), scale)


def record_figures(records: Sequence[Any]) -> RecordFigures:
    """What the summary reads of ``records`` (``RequestRecord`` s), in one pass: see
    ``RecordFigures``. The completed requests' series in record order: ``e2e`` and ``itl`` of
    each, ``ttft`` of those with a first token and ``tpot`` of those with two or more, the
    prompt and cached tokens of those that report usage (``cached_tokens or 0``). Always an
    answer (the native module's None: "the twin's case")."""
    failed: list[Any] = []
    ttft: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    itl: list[list[float]] = []
    inputs: list[int] = []
    outputs: list[int] = []
    prompt_total = cached_total = output_total = mismatch = 0
    for r in records:
        if r.error is not None:
            failed.append(r)
            continue
        out = r.output_tokens
        output_total += out
        outputs.append(out)
        itl.append(r.itl)
        e2e.append(r.e2e)
        first = r.ttft
        if first is not None:
            ttft.append(first)
            per_token = r.tpot
            if per_token is not None:
                tpot.append(per_token)
        prompt = r.prompt_tokens
        if prompt is not None:
            inputs.append(prompt)
            prompt_total += prompt
            cached_total += r.cached_tokens or 0
            mismatch += prompt != r.expected_prompt_tokens
    ms = 1000.0
    gaps = chain.from_iterable(itl)
    series = (_figures(ttft, ms), _figures(gaps, ms), _figures(tpot, ms), _figures(e2e, ms))
    counts = (_figures(inputs, 1.0), _figures(outputs, 1.0))
    ok = len(records) - len(failed)
    return (ok, failed, *series, *counts, output_total, prompt_total, cached_total, mismatch)

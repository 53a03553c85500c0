"""Type stub of the native module ``dynamo.bench._stats`` (source: ``_stats.c``; the same contract
in Python: ``_stats_fallback.py``). Import through ``dynamo.bench.report``."""

from typing import Any

Figures = tuple[
    int, float | None, float | None, float | None, float | None, float | None, float | None
]

def figures(values: list[float], scale: float) -> Figures | None:
    """``(count, mean, min, p50, p90, p99, max)`` of ``sorted(v * scale for v in values)``,
    the mean ``sum`` of that sorted list over its length, the percentiles linear between
    neighbours (``bench.report.percentile``); ``(0, None, ...)`` for no values. Bit-identical
    to the Python twin, or None where this implementation cannot promise that (a NaN, an item
    that is not an exact float or int, a scale that is not a float): the caller then uses
    the twin. TypeError if ``values`` is not a list; OverflowError for an int too large for a
    float."""

def figures_joined(lists: list[list[float]], scale: float) -> Figures | None:
    """``figures`` of the lists' items in order (``itertools.chain`` of them), read from the
    lists themselves; None, besides ``figures``' cases, when an item of ``lists`` is not a
    list. TypeError if ``lists`` is not a list."""

RecordFigures = tuple[
    int, list[Any], Figures, Figures, Figures, Figures, Figures, Figures, int, int, int, int
]

def record_figures(records: list[Any]) -> RecordFigures | None:
    """What ``bench.report.summarize`` reads of a run's ``RequestRecord`` s, in one pass:
    completed, the failed records (in order), the figures of ttft, itl, tpot and e2e (ms, each
    as ``figures``), input and output tokens, then the output, prompt and cached token totals
    and the count of prompts whose size differs from the expected. The same values as the
    twin's definition, or None where this implementation cannot promise that (a record that
    is not exactly a ``RequestRecord``, a field that is not an exact float / int within 64
    bits / list / None as a run writes them, a total past 64 bits, a NaN, ``figures``' cases).
    TypeError if ``records`` is not a list."""

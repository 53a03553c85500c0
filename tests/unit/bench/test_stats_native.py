"""bench/_stats.c against its fallback (the definition: scaled, sorted, summed in order): the
same floats, bit for bit, for the series the report holds and the edge cases, and the same
counts and figures of a run's records; and the cases the native module hands back to the
fallback."""

from __future__ import annotations

import math
import random
import struct
from types import ModuleType
from typing import Any

import pytest

from dynamo.bench import _stats_fallback as py
from dynamo.bench.report import stats, stats_joined, summarize
from dynamo.bench.request import RequestRecord


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.bench._stats")


def bits(figures: tuple[object, ...] | None) -> list[object]:
    assert figures is not None
    return [struct.pack("<d", v) if isinstance(v, float) else v for v in figures]


def series(rng: random.Random, n: int) -> list[float]:
    """Latency-like values with many exact ties (a pass's tokens share one gap), zeros of
    both signs and a few large outliers."""
    gaps = [rng.uniform(0.001, 0.08) for _ in range(max(1, n // 7))]
    out = [rng.choice(gaps) if rng.random() < 0.8 else rng.expovariate(30.0) for _ in range(n)]
    for _ in range(n // 50):
        out[rng.randrange(n)] = rng.choice((0.0, -0.0, 5.0 + rng.random(), 1e-300))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 31, 32, 33, 64, 65, 1000, 40_000])
@pytest.mark.parametrize("scale", [1.0, 1000.0, 0.1])
def test_same_floats_as_the_definition(native: ModuleType, n: int, scale: float) -> None:
    rng = random.Random(n * 7 + int(scale))
    values = series(rng, n)
    assert bits(native.figures(values, scale)) == bits(py.figures(values, scale))
    ints = [rng.randrange(0, 5000) for _ in range(n)]  # token counts
    assert bits(native.figures(ints, scale)) == bits(py.figures(ints, scale))


def test_signed_zeros_and_ties_keep_their_input_order(native: ModuleType) -> None:
    for values in ([-0.0, 0.0, -0.0], [0.0, -0.0], [-0.0] * 40 + [0.0] * 40, [1.0, -1.0, 0.0]):
        assert bits(native.figures(values, 1.0)) == bits(py.figures(values, 1.0))
    assert math.copysign(1.0, native.figures([-0.0], 1.0)[2]) == -1.0


def test_empty_and_deferred_cases(native: ModuleType) -> None:
    assert native.figures([], 1000.0) == py.figures([], 1000.0) == (0, *[None] * 6)
    assert native.figures([1.0, math.nan, 2.0], 1.0) is None  # no total order: the definition
    assert native.figures([1.0, True], 1.0) is None  # not an exact float or int
    assert native.figures([1.0, 2.0], 2) is None  # an int scale keeps int products
    inf = native.figures([1.0, math.inf], 1.0)
    assert inf is not None and inf[-1] == math.inf
    with pytest.raises(TypeError):
        native.figures((1.0, 2.0), 1.0)
    with pytest.raises(OverflowError):
        native.figures([10**400], 1.0)
    with pytest.raises(OverflowError):
        py.figures([10**400], 1.0)


def test_report_stats_either_way() -> None:
    values = series(random.Random(5), 5_000)
    want = py.figures(values, 1000.0)
    row = stats(iter(values), 1000.0)  # any iterable
    assert list(row.values()) == list(want)
    assert list(row) == ["count", "mean", "min", "p50", "p90", "p99", "max"]
    nan_row = stats([2.0, math.nan, 1.0])
    assert nan_row["count"] == 3  # computed by the definition
    assert list(stats([])) == ["mean", "min", "p50", "p90", "p99", "max", "count"]


@pytest.mark.parametrize("seed", range(4))
def test_long_series_without_negative_zero_sort_the_same(native: ModuleType, seed: int) -> None:
    """A long series with no -0.0 is radix-sorted: the same floats as the definition, over
    signs, zeros, ties, subnormals, infinities and one shared exponent."""
    rng = random.Random(seed)
    n = rng.choice((256, 257, 3_000, 50_000))
    values = [v for v in series(rng, n) if not (v == 0.0 and math.copysign(1.0, v) < 0)]
    values += [-rng.expovariate(1.0) for _ in range(n // 9)] + [0.0, 5e-324, -5e-324]
    values += [math.inf, -math.inf, -1e300, 1.5, 1.5, 1.5]
    rng.shuffle(values)
    for scale in (1.0, 1000.0, 1e-3):
        assert bits(native.figures(values, scale)) == bits(py.figures(values, scale))
    same_exponent = [1.0 + rng.random() for _ in range(10_000)]  # passes skipped
    assert bits(native.figures(same_exponent, 1.0)) == bits(py.figures(same_exponent, 1.0))


def test_joined_series_are_the_figures_of_the_joined_list(native: ModuleType) -> None:
    rng = random.Random(11)
    lists = [series(rng, rng.randrange(0, 40)) for _ in range(500)] + [[], [3], [1e6]]
    joined = [v for part in lists for v in part]
    want = bits(py.figures(joined, 1000.0))
    assert bits(native.figures_joined(lists, 1000.0)) == want
    assert bits(py.figures_joined(lists, 1000.0)) == want
    assert native.figures_joined([], 1.0) == py.figures_joined([], 1.0) == (0, *[None] * 6)
    assert native.figures_joined([[1.0], (2.0,)], 1.0) is None  # not a list: the twin joins it
    assert native.figures_joined([[1.0], [math.nan]], 1.0) is None
    with pytest.raises(TypeError):
        native.figures_joined(([1.0],), 1.0)
    row = stats_joined(lists, 1000.0)
    assert list(row.values()) == list(py.figures(joined, 1000.0))
    assert stats_joined([[], []])["count"] == 0


def tied_series(rng: random.Random, n: int, distinct: int) -> list[float]:
    """A long series of few distinct values (a replay's ITLs: a pass's tokens share one gap),
    with the extremes a float can take but no -0.0."""
    pool = [rng.uniform(0.001, 0.08) for _ in range(distinct - 7)]
    pool += [0.0, 5e-324, math.inf, -math.inf, -1e300, 1.5, -rng.random()]
    return [rng.choice(pool) for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_long_tied_series_are_counted_by_value_the_same(native: ModuleType, seed: int) -> None:
    """Past 4,096 values with few distinct ones the native module counts each distinct value
    (the joined ITLs of a replay); the figures stay the definition's, with percentiles on the
    borders between runs of equal values, and whatever the lists' split."""
    rng = random.Random(seed)
    n = rng.choice((4096, 4097, 9_999, 60_000))
    values = tied_series(rng, n, rng.choice((8, 40, 400)))
    if seed < 2:  # enough distinct values for the table to grow while counts are pending
        values = tied_series(rng, 60_000, 3_000)
    if seed % 2:
        values = [v for v in values if math.isfinite(v)]
    for scale in (1.0, 1000.0):
        want = bits(py.figures(values, scale))
        assert bits(native.figures(values, scale)) == want
        cuts = sorted(rng.sample(range(len(values)), 50))
        lists = [values[a:b] for a, b in zip([0, *cuts], [*cuts, len(values)], strict=True)]
        assert bits(native.figures_joined(lists, scale)) == want
    # borders: the p50 place is the last 1.0, between the two values, or the first 2.0
    for more in (-1, 0, 1):
        edge = [1.0] * 8192 + [2.0] * (8192 + more)
        assert bits(native.figures(edge, 1.0)) == bits(py.figures(edge, 1.0))


def test_long_series_that_do_not_suit_counting_take_the_array_path(native: ModuleType) -> None:
    """Too many distinct values, a -0.0 among ties (its input order shows), a NaN or an odd
    item late in the series: the same answers as the definition (or None: the twin's case)."""
    rng = random.Random(3)
    distinct = [rng.random() for _ in range(10_000)]  # every value its own
    many = tied_series(rng, 5_000, 20) + distinct
    assert bits(native.figures(many, 1000.0)) == bits(py.figures(many, 1000.0))
    zeros = tied_series(rng, 5_000, 20) + [-0.0, 0.0, -0.0]
    assert bits(native.figures(zeros, 1.0)) == bits(py.figures(zeros, 1.0))
    late_nan = tied_series(rng, 5_000, 20) + [math.nan]
    assert native.figures(late_nan, 1.0) is None
    assert native.figures_joined([tied_series(rng, 5_000, 20), [1.0, "x"]], 1.0) is None
    with pytest.raises(OverflowError):
        native.figures([*tied_series(rng, 5_000, 20), 10**400], 1.0)


def mixed_records(rng: random.Random, n: int) -> list[RequestRecord]:
    """Records as runs leave them: failures, no first token, fewer than two tokens, no usage,
    cached tokens None or 0, prompts of the expected size or not, ITLs with ties."""
    gaps = [rng.uniform(0.001, 0.05) for _ in range(30)]
    records = []
    for i in range(n):
        start = rng.random()
        r = RequestRecord(start=start, max_tokens=8, expected_prompt_tokens=100)
        r.end = start + rng.random()
        r.ttft = None if rng.random() < 0.1 else rng.random() / 10
        r.output_tokens = rng.choice([0, 1, 2, 9, 33])
        r.itl = [rng.choice(gaps) for _ in range(rng.randrange(40))]
        if rng.random() < 0.8:
            r.prompt_tokens = rng.choice([100, 100, 99])
            r.cached_tokens = rng.choice([None, 0, 64])
        if rng.random() < 0.1:
            r.error, r.error_message = rng.choice(["timeout", "http_503"]), f"m{i}"
        records.append(r)
    return records


def deep_bits(value: object) -> object:
    if isinstance(value, tuple):
        return tuple(deep_bits(v) for v in value)
    return struct.pack("<d", value) if isinstance(value, float) else value


@pytest.mark.parametrize("n", [0, 1, 50, 400])
def test_record_figures_are_the_definitions(native: ModuleType, n: int) -> None:
    records = mixed_records(random.Random(n), n)
    got, want = native.record_figures(records), py.record_figures(records)
    assert deep_bits(got) == deep_bits(want)
    assert got is not None and got[1] == [r for r in records if r.error is not None]


def _odd(record: RequestRecord, field: str, value: object) -> RequestRecord:
    setattr(record, field, value)
    return record


class _Subclass(RequestRecord):
    @property
    def e2e(self) -> float:
        return 1.0


@pytest.mark.parametrize(
    "odd",
    [
        lambda r: _odd(r, "start", 0),  # an int time
        lambda r: _odd(r, "end", math.nan),
        lambda r: _odd(r, "ttft", 1),
        lambda r: _odd(r, "itl", (0.1, 0.2)),  # not a list
        lambda r: _odd(r, "itl", [0.1, math.nan]),
        lambda r: _odd(r, "output_tokens", True),
        lambda r: _odd(r, "output_tokens", 2**70),
        lambda r: _odd(r, "prompt_tokens", 10.0),
        lambda r: _odd(r, "cached_tokens", 1.5),
        lambda r: _odd(r, "expected_prompt_tokens", 2**64),
        lambda r: _Subclass(start=r.start, max_tokens=1, expected_prompt_tokens=1, end=r.end),
    ],
)
def test_record_figures_defer_what_a_run_does_not_write(native: ModuleType, odd: Any) -> None:
    """Records the native pass cannot promise the definition's figures for go to the twin; the
    report's summary is the definition's either way."""
    records = mixed_records(random.Random(9), 60)
    records = [r for r in records if r.error is None and r.prompt_tokens is not None]
    records[len(records) // 2] = odd(records[len(records) // 2])
    assert native.record_figures(records) is None
    summary = summarize(records, window_s=1.0)
    want = py.record_figures(records)
    assert want is not None
    keys = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms", "input_tokens", "output_tokens")
    got = tuple(tuple(summary[key].values()) for key in keys)
    assert deep_bits(got) == deep_bits(want[2:8])


def test_record_figures_totals_past_64_bits_defer(native: ModuleType) -> None:
    records = mixed_records(random.Random(4), 3)
    for r in records:
        r.error, r.output_tokens = None, 2**62
    assert native.record_figures(records) is None
    assert py.record_figures(records)[8] == 3 * 2**62
    with pytest.raises(TypeError):
        native.record_figures(tuple(records))


def test_constant_series_need_no_sort(native: ModuleType) -> None:
    """A series of one value (a synthetic workload's token counts) is already sorted: the same
    figures, infinities and signed zeros included."""
    for value in (1152, 32.0, -0.0, 0.0, math.inf, -math.inf, 5e-324):
        for n in (1, 300, 20_000):
            series_ = [value] * n
            assert bits(native.figures(series_, 1.0)) == bits(py.figures(series_, 1.0))
    almost = [7.0] * 5_000 + [-0.0]
    assert bits(native.figures(almost, 1.0)) == bits(py.figures(almost, 1.0))

"""bench/_stats.c against its fallback (the definition: scaled, sorted, summed in order): the
same floats, bit for bit, for the series the report holds and the edge cases; and the cases the
native module hands back to the fallback."""

from __future__ import annotations

import math
import random
import struct
from types import ModuleType

import pytest

from dynamo.bench import _stats_fallback as py
from dynamo.bench.report import stats, stats_joined


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

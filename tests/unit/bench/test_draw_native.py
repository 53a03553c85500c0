"""bench/_draw.c against its fallback (``random.choices``): the same words and the same draws
from the generator, for the populations and counts the workloads use and the edge cases."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from dynamo.bench import _draw_fallback as py


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.bench._draw")


class Skewed(random.Random):
    """A generator whose ``random`` is Python code: it must be called, not bypassed."""

    def random(self) -> float:
        return super().random() ** 2


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("make", [random.Random, Skewed])
def test_same_words_and_draws_as_random_choices(
    native: ModuleType, seed: int, make: type[random.Random]
) -> None:
    population = list(range(1000, 1000 + 7 * (seed + 1)))
    a, b = make(seed), make(seed)
    for k in (0, 1, 5, 128, 1024, -3):
        assert native.choices(a, population, k) == py.choices(b, population, k)
        assert a.getstate() == b.getstate()
    assert native.choices(a, tuple("abc"), 4) == py.choices(b, tuple("abc"), 4)
    assert native.choices(a, "xyz", 4) == py.choices(b, "xyz", 4)


def test_bad_input_is_refused_as_random_choices_refuses_it(native: ModuleType) -> None:
    for impl in (native, py):
        with pytest.raises(IndexError):
            impl.choices(random.Random(0), [], 2)
        assert impl.choices(random.Random(0), [], 0) == []
        with pytest.raises(TypeError):
            impl.choices(random.Random(0), [1, 2], "3")
    with pytest.raises(TypeError):
        native.choices(random.Random(0), 5, 2)
    with pytest.raises(AttributeError):
        native.choices(object(), [1], 1)

"""bench/_draw.c against its fallback (``random.choices``): the same words and the same draws
from the generator, for the populations and counts the workloads use and the edge cases."""

from __future__ import annotations

import random
from array import array
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


class WithState(random.Random):
    """A subclass that keeps the built-in ``random`` (drawn in place) and adds a field."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.label = "x"


def test_the_built_in_generator_is_drawn_in_place_with_its_own_values(
    native: ModuleType,
) -> None:
    assert native.in_place()  # CPython's layout matched at import on this interpreter
    for make in (random.Random, WithState):
        a, b = make(7), make(7)
        for k in (1, 3, 311, 624, 625, 2000):  # across the state's regenerations
            assert native.choices(a, range(10**6), k) == py.choices(b, range(10**6), k)
            assert a.getstate() == b.getstate()
        assert a.random() == b.random()  # the generator goes on where the draws left it


@pytest.mark.parametrize("seed", range(8))
def test_extended_is_the_head_then_the_same_draws(native: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    population = list(range(100, 100 + rng.randint(1, 900)))
    head = [rng.randrange(10**9) for _ in range(rng.randint(0, 300))]
    for make in (random.Random, Skewed):
        a, b = make(seed), make(seed)
        for total in (0, 1, len(head) // 2, len(head), len(head) + 1, len(head) + 200):
            got = native.extended(a, population, head, total)
            assert got == py.extended(b, population, head, total)
            assert len(got) == total and got[: min(total, len(head))] == head[:total]
            assert a.getstate() == b.getstate()
    assert native.extended(a, population, tuple(head), 5) == py.extended(b, population, head, 5)


def test_extended_refuses_what_its_twin_refuses(native: ModuleType) -> None:
    for impl in (native, py):
        with pytest.raises(ValueError):
            impl.extended(random.Random(0), [1], [1, 2], -1)
        with pytest.raises(IndexError):
            impl.extended(random.Random(0), [], [1], 2)
        assert impl.extended(random.Random(0), [], [1, 2], 1) == [1]
    with pytest.raises(TypeError):
        native.extended(random.Random(0), [1], 5, 2)


@pytest.mark.parametrize("seed", range(6))
def test_packed_is_extended_as_u32_ids(native: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    population = list(range(100, 100 + rng.randint(1, 900)))
    head = [rng.randrange(1 << 32) for _ in range(rng.randint(0, 300))]
    for make in (random.Random, Skewed):
        a, b, c = make(seed), make(seed), make(seed)
        for total in (0, 1, len(head) // 2, len(head), len(head) + 1, len(head) + 200):
            words = array("I", population)
            got = native.packed(a, words, array("I", head), total)
            assert type(got) is array and got.typecode == "I"
            assert got == py.packed(b, words, array("I", head), total)
            assert got.tolist() == native.extended(c, population, head, total)
            assert a.getstate() == b.getstate() == c.getstate()


def test_packed_refuses_what_its_twin_refuses(native: ModuleType) -> None:
    for impl in (native, py):
        one = array("I", [1])
        with pytest.raises(ValueError):
            impl.packed(random.Random(0), one, array("I", [1, 2]), -1)
        with pytest.raises(IndexError):
            impl.packed(random.Random(0), array("I"), one, 2)
        with pytest.raises(TypeError):
            impl.packed(random.Random(0), [1], one, 2)
        with pytest.raises(TypeError):
            impl.packed(random.Random(0), one, array("H", [1]), 2)
        assert impl.packed(random.Random(0), array("I"), array("I", [1, 2]), 1).tolist() == [1]

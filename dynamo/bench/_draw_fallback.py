"""Pure-Python twin of ``dynamo.bench._draw`` (contract: ``_draw.pyi``), used where the extension
is not built or ``DYN_NATIVE=0``. Import through ``dynamo.bench.draw``."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def choices(rng: random.Random, population: Sequence[T], k: int) -> list[T]:
    return rng.choices(population, k=k)


def extended(rng: random.Random, population: Sequence[T], head: Sequence[T], total: int) -> list[T]:
    if total < 0:
        raise ValueError("a prompt's length cannot be negative")
    out = list(head[:total])
    out += rng.choices(population, k=total - len(out))
    return out


def packed(rng: random.Random, words: array[int], head: array[int], total: int) -> array[int]:
    if total < 0:
        raise ValueError("a prompt's length cannot be negative")
    if not all(isinstance(a, array) and a.typecode == "I" for a in (words, head)):
        raise TypeError("the words and the head must be array('I')s")
    out = head[:total]
    out.extend(rng.choices(words, k=total - len(out)))
    return out

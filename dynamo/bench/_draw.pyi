"""Type stub of the native module ``dynamo.bench._draw`` (source: ``_draw.c``; the same contract
in Python: ``_draw_fallback.py``). Import through ``dynamo.bench.draw``."""

import random
from array import array
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

def choices(rng: random.Random, population: Sequence[T], k: int) -> list[T]:
    """``rng.choices(population, k=k)``: ``k`` uniform draws with replacement, the same items
    and the same draws from ``rng`` (one ``rng.random()`` per item; ``k`` <= 0: none).
    IndexError for an empty population and ``k`` > 0."""

def extended(rng: random.Random, population: Sequence[T], head: Sequence[T], total: int) -> list[T]:
    """A new list of ``total`` items: ``head[:total]``, then ``total - len(head[:total])``
    uniform draws from ``population`` exactly as ``choices`` draws them (a token-id prompt: its
    shared words, then its own). ValueError for a negative ``total``; IndexError for an empty
    population when draws are needed."""

def packed(rng: random.Random, words: array[int], head: array[int], total: int) -> array[int]:
    """``extended``'s prompt as an ``array('I')``, its population (``words``) and ``head``
    ``array('I')``s too, packed once: the same draws and ids, with no int object per id to
    copy, hash or free (the offline replay's token-id prompts). TypeError for another
    ``words`` or ``head``."""

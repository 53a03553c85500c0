"""Type stub of the native module ``dynamo.engine_core._sequence`` (source: ``_sequence.c``;
the same contract in Python: ``_sequence_fallback.py``). Import through
``dynamo.engine_core.sequence``."""

from typing import Any, TypeVar

T = TypeVar("T")

def build(cls: type[T], values: tuple[Any, ...]) -> T:
    """An object of the slotted class ``cls`` (``__slots__`` of plain object slots, e.g. a
    ``@dataclass(slots=True)``) whose slots, in ``__slots__`` order, hold ``values``; its
    ``__init__`` and ``__post_init__`` are not called: the caller computes what they would.
    ValueError unless there is one value per slot; TypeError for a class of other slots."""

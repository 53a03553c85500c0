"""Type stub of the native module ``dynamo.engine_core._sequence`` (source: ``_sequence.c``;
the same contract in Python: ``_sequence_fallback.py``). Import through
``dynamo.engine_core.sequence``."""

from array import array
from collections.abc import Iterable
from typing import Any, TypeVar

from dynamo.engine_core.config import SchedulerLimits
from dynamo.engine_core.sequence import Sequence
from dynamo.protocol.disagg import DisaggregatedParams

T = TypeVar("T")

def build(cls: type[T], values: tuple[Any, ...]) -> T:
    """An object of the slotted class ``cls`` (``__slots__`` of plain object slots, e.g. a
    ``@dataclass(slots=True)``) whose slots, in ``__slots__`` order, hold ``values``; its
    ``__init__`` and ``__post_init__`` are not called: the caller computes what they would.
    ValueError unless there is one value per slot; TypeError for a class of other slots."""

def new_sequence(
    config: SchedulerLimits,
    token_ids: list[int] | array[int],
    request_id: str,
    now: float,
    *,
    max_tokens: int | None,
    min_tokens: int = 0,
    stop_token_ids: Iterable[int] = (),
    eos_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    lora_name: str | None = None,
    seed: int | None = None,
    handoff: DisaggregatedParams | None = None,
    reuse_prefix_cache: bool = True,
    seed_id: str | None = None,
    hashes: tuple[list[int], list[int]] | None = None,
) -> Sequence:
    """``sequence_from_request`` from the request's fields (the same checks and result), for a
    caller that holds them without a ``PreprocessedRequest`` (the offline replay builds one
    sequence per simulated request): ``InvalidArgument`` if the request can never run on this
    worker. ``token_ids`` becomes the sequence's ``prompt`` (kept, never changed: the caller
    must not change it either); ``hashes``, the prompt's (local, sequence) block hashes, are
    handed over when they cover its complete blocks (the sequence appends its output's blocks
    to them), else the prompt is hashed. The fields are what ``Sequence(...)`` and its
    ``__post_init__`` would set, built without them (``build``). The native version takes the
    common call (four positional arguments, exact ints and strs) and hands any other, and every
    refused request, to the Python one, which raises the errors."""

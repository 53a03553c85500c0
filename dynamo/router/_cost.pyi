"""Type stub of the native module ``dynamo.router._cost`` (source: ``_cost.c``; the same
contract in Python: ``_cost_fallback.py``). Import through ``dynamo.router.selector``."""

import random
from collections.abc import Sequence

STATE_DRAWS: bool
"""Whether a plain ``random.Random``'s tie draws are read from its Mersenne Twister state
(``_cost.h``: the layout checked at import against the generator's own ``getrandbits``); if
not, through its ``getrandbits`` method. The draws are the same either way."""

def costs(
    overlap: Sequence[int],
    prefill: Sequence[int],
    decode: Sequence[int],
    new: Sequence[int],
    requests: Sequence[int],
    isl_tokens: int,
    block_size: int,
    params: tuple[float, float, float, float, bool],
) -> list[float]:
    """The cost (FACTS §4.2, lower is better) of each candidate ``i``: matched blocks
    ``overlap[i]``, active prefill tokens ``prefill[i]``, active decode blocks ``decode[i]``,
    the request's blocks new there ``new[i]``, active requests ``requests[i]``. ``params`` =
    (overlap score credit, prefill load scale, decode active-request weight, credit decay,
    track prefill tokens). ValueError for ``block_size <= 0`` or columns of unequal length."""

def argmin_random_tie(values: Sequence[float], rng: random.Random) -> int:
    """Index of the minimum; ties broken uniformly by reservoir sampling: each value equal to
    the running minimum draws ``rng.randrange(ties)`` and wins on 0."""

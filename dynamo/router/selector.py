"""KV router selection policy (FACTS §4.2-§4.4): the cost of each candidate (worker, dp_rank),
busy filtering and temperature sampling. Pure: every input is a number handed in by the caller.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from dynamo import native
from dynamo.router.slots import WorkerKey
from dynamo.runtime.errors import NoInstances, Overloaded

_kernel = native.load("dynamo.router._cost", "dynamo.router._cost_fallback")
IMPLEMENTATION: str = _kernel.__name__
"""The cost kernel in use (``dynamo.router._cost`` or ``dynamo.router._cost_fallback``)."""
if TYPE_CHECKING:
    from dynamo.router._cost import argmin_random_tie as _argmin_random_tie
    from dynamo.router._cost import costs as _costs
else:
    _argmin_random_tie, _costs = _kernel.argmin_random_tie, _kernel.costs


@dataclass(frozen=True, slots=True)
class SelectorConfig:
    """Reference defaults (KvRouterConfig). Every field is set from a flag of
    ``router/config.py`` (``KVRouterSettings.selector_config``), named beside it."""

    overlap_score_credit: float = 1.0  # --router-kv-overlap-score-credit
    prefill_load_scale: float = 1.0  # --kv-overlap-score-weight
    temperature: float = 0.0  # --router-temperature
    decode_active_request_weight: float = 0.0  # --router-decode-active-request-weight
    overlap_score_credit_decay: float = 0.0  # --router-kv-overlap-score-credit-decay
    track_prefill_tokens: bool = True  # --router-track-prefill-tokens
    active_decode_blocks_threshold: float | None = None  # --active-decode-blocks-threshold, [0,1]
    active_prefill_tokens_threshold: int | None = None  # --active-prefill-tokens-threshold
    active_prefill_tokens_threshold_frac: float | None = (
        None  # --active-prefill-tokens-threshold-frac
    )

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        for name in (
            "overlap_score_credit",
            "prefill_load_scale",
            "decode_active_request_weight",
            "overlap_score_credit_decay",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        t = self.active_decode_blocks_threshold
        if t is not None and not 0.0 <= t <= 1.0:
            raise ValueError("active_decode_blocks_threshold must be in [0, 1]")
        if (
            self.active_prefill_tokens_threshold is not None
            and self.active_prefill_tokens_threshold < 0
        ):
            raise ValueError("active_prefill_tokens_threshold must be >= 0")
        f = self.active_prefill_tokens_threshold_frac
        if f is not None and f < 0:
            raise ValueError("active_prefill_tokens_threshold_frac must be >= 0")

    @property
    def cost_params(self) -> tuple[float, float, float, float, bool]:
        """The cost kernel's ``params`` (``_cost.pyi``)."""
        return (
            float(self.overlap_score_credit),
            float(self.prefill_load_scale),
            float(self.decode_active_request_weight),
            float(self.overlap_score_credit_decay),
            self.track_prefill_tokens,
        )

    @property
    def has_busy_thresholds(self) -> bool:
        """Whether any busy threshold is set (by default nobody is ever busy)."""
        return (
            self.active_decode_blocks_threshold is not None
            or self.active_prefill_tokens_threshold is not None
            or self.active_prefill_tokens_threshold_frac is not None
        )


@dataclass(slots=True)
class Candidate:
    """One eligible target and its load, as the indexer and ActiveSequences report them.

    ``active_prefill_tokens`` / ``active_decode_blocks`` exclude the new request;
    ``new_decode_blocks`` is how many of the request's blocks are not yet active there
    (so potential decode blocks = active_decode_blocks + new_decode_blocks).
    """

    worker_id: int
    dp_rank: int = 0
    overlap_blocks: int = 0
    active_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    new_decode_blocks: int = 0
    active_requests: int = 0
    total_kv_blocks: int | None = None  # needed by the decode-blocks busy threshold
    max_num_batched_tokens: int | None = None  # needed by the fractional prefill threshold

    @property
    def key(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)

    @property
    def potential_decode_blocks(self) -> int:
        return self.active_decode_blocks + self.new_decode_blocks


class Selection(msgspec.Struct, frozen=True):
    """The chosen (worker, dp_rank) and why. A Struct, not a frozen dataclass: one is built on
    every routing decision, and a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__`` (~5 µs for these seven; Struct.__init__ runs in C)."""

    worker_id: int
    dp_rank: int
    cost: float
    overlap_blocks: int  # device blocks of the request already cached on the chosen target
    cached_tokens: int  # min(overlap_blocks * block_size, isl): the predicted KV hit
    scored: Sequence[WorkerKey]  # every scored candidate, in scoring order
    scores: Sequence[float]  # their costs, same order (lower is better)

    @property
    def key(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)

    @property
    def costs(self) -> dict[WorkerKey, float]:
        """Every scored candidate's cost, built on demand (a router with 100 workers routes
        far more often than anyone reads this)."""
        return dict(zip(self.scored, self.scores, strict=True))


def is_busy(c: Candidate, cfg: SelectorConfig) -> bool:
    """Busy per §4.4 (strictly above a threshold; an unknown capacity never makes a worker busy)."""
    t = cfg.active_decode_blocks_threshold
    if t is not None and c.total_kv_blocks is not None:
        if c.active_decode_blocks > t * c.total_kv_blocks:
            return True
    pt = cfg.active_prefill_tokens_threshold
    if pt is not None and c.active_prefill_tokens > pt:
        return True
    f = cfg.active_prefill_tokens_threshold_frac
    if f is not None and c.max_num_batched_tokens is not None:
        if c.active_prefill_tokens > f * c.max_num_batched_tokens:
            return True
    return False


def candidate_costs(
    candidates: Sequence[Candidate], isl_tokens: int, block_size: int, cfg: SelectorConfig
) -> list[float]:
    """The cost (logit) of each candidate, lower is better (§4.2; computed by the cost kernel,
    ``_cost.pyi``)."""
    return _costs(
        [c.overlap_blocks for c in candidates],
        [c.active_prefill_tokens for c in candidates],
        [c.active_decode_blocks for c in candidates],
        [c.new_decode_blocks for c in candidates],
        [c.active_requests for c in candidates],
        isl_tokens,
        block_size,
        cfg.cost_params,
    )


def select_worker(
    candidates: Sequence[Candidate],
    isl_tokens: int,
    block_size: int,
    cfg: SelectorConfig,
    rng: random.Random,
    *,
    temperature: float | None = None,
) -> Selection:
    """Pick a target: drop busy candidates, score the rest, argmin (T=0) or softmax sample (T>0).

    ``temperature`` overrides ``cfg.temperature`` for one request. Raises NoInstances when there
    are no candidates and Overloaded when every candidate is busy.
    """
    if not candidates:
        raise NoInstances("no worker instances are available for this request")
    if not cfg.has_busy_thresholds:  # the default: nobody is ever busy
        eligible = list(candidates)
    else:
        eligible = [c for c in candidates if not is_busy(c, cfg)]
    if not eligible:
        raise Overloaded(
            f"all {len(candidates)} eligible workers are busy "
            "(above the active decode-blocks / prefill-tokens thresholds); retry later"
        )
    costs = candidate_costs(eligible, isl_tokens, block_size, cfg)
    i = choose(costs, cfg, rng, temperature)
    chosen = eligible[i]
    return Selection(
        worker_id=chosen.worker_id,
        dp_rank=chosen.dp_rank,
        cost=costs[i],
        overlap_blocks=chosen.overlap_blocks,
        cached_tokens=min(chosen.overlap_blocks * block_size, max(isl_tokens, 0)),
        scored=[c.key for c in eligible],
        scores=costs,
    )


def choose(
    costs: Sequence[float],
    cfg: SelectorConfig,
    rng: random.Random,
    temperature: float | None = None,
) -> int:
    """The index chosen among ``costs``: argmin with uniform random tie-breaks (temperature 0)
    or a softmax sample (§4.3). ``temperature`` overrides ``cfg.temperature``."""
    t = cfg.temperature if temperature is None else temperature
    if t < 0:
        raise ValueError("temperature must be >= 0")
    return _argmin_random_tie(costs, rng) if t == 0 else _softmax_sample(costs, t, rng)


def column_costs(
    overlap: Sequence[int],
    prefill: Sequence[int],
    decode: Sequence[int],
    new: Sequence[int],
    requests: Sequence[int],
    isl_tokens: int,
    block_size: int,
    cfg: SelectorConfig,
) -> list[float]:
    """:func:`candidate_costs` over columns (one item per candidate in each), for a caller that
    holds its loads as columns (``RoutingCore``: no ``Candidate`` per target)."""
    return _costs(overlap, prefill, decode, new, requests, isl_tokens, block_size, cfg.cost_params)


def _softmax_sample(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Sample with p_i ∝ exp(-(c_i - min) / ((max - min) * T)); uniform if all costs are equal."""
    lo, hi = min(costs), max(costs)
    if hi == lo:
        return rng.randrange(len(costs))
    scale = (hi - lo) * temperature
    weights = [math.exp(-(c - lo) / scale) for c in costs]
    u = rng.random() * sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if u < acc:
            return i
    return len(costs) - 1

"""KV router selection policy (FACTS §4.2-§4.4): the cost of each candidate (worker, dp_rank),
busy filtering and temperature sampling. Pure: every input is a number handed in by the caller.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from dynamo.router.slots import WorkerKey
from dynamo.runtime.errors import NoInstances, Overloaded


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


@dataclass(frozen=True, slots=True)
class Selection:
    worker_id: int
    dp_rank: int
    cost: float
    overlap_blocks: int  # device blocks of the request already cached on the chosen target
    cached_tokens: int  # min(overlap_blocks * block_size, isl): the predicted KV hit
    costs: dict[WorkerKey, float]  # every scored candidate's cost (lower is better)

    @property
    def key(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)


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
    """The cost (logit) of each candidate, lower is better (§4.2)."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    b = float(block_size)
    request_blocks = max(1.0, isl_tokens / b)
    decay_on = cfg.overlap_score_credit_decay > 0 and cfg.track_prefill_tokens
    min_prefill = min(c.active_prefill_tokens for c in candidates) if decay_on else 0
    out: list[float] = []
    for c in candidates:
        decay = 1.0
        if decay_on:
            excess = (c.active_prefill_tokens - min_prefill) / b
            decay = 1.0 / (1.0 + cfg.overlap_score_credit_decay * excess / request_blocks)
        # (the reference also credits host- and disk-tier hits; there are no such tiers here)
        credit = cfg.overlap_score_credit * decay * c.overlap_blocks
        requests = cfg.decode_active_request_weight * c.active_requests
        if cfg.track_prefill_tokens:
            prefill = max(0.0, (c.active_prefill_tokens + isl_tokens) / b - credit)
            cost = cfg.prefill_load_scale * prefill + c.potential_decode_blocks + requests
        elif cfg.overlap_score_credit > 0:  # decode-only router: the credit offsets decode load
            cost = max(0.0, c.potential_decode_blocks - credit) + requests
        else:
            cost = c.potential_decode_blocks + requests
        out.append(cost)
    return out


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
    thresholds = (
        cfg.active_decode_blocks_threshold,
        cfg.active_prefill_tokens_threshold,
        cfg.active_prefill_tokens_threshold_frac,
    )
    if thresholds == (None, None, None):  # the default: nobody is ever busy
        eligible = list(candidates)
    else:
        eligible = [c for c in candidates if not is_busy(c, cfg)]
    if not eligible:
        raise Overloaded(
            f"all {len(candidates)} eligible workers are busy "
            "(above the active decode-blocks / prefill-tokens thresholds); retry later"
        )
    costs = candidate_costs(eligible, isl_tokens, block_size, cfg)
    t = cfg.temperature if temperature is None else temperature
    if t < 0:
        raise ValueError("temperature must be >= 0")
    i = _argmin_random_tie(costs, rng) if t == 0 else _softmax_sample(costs, t, rng)
    chosen = eligible[i]
    return Selection(
        worker_id=chosen.worker_id,
        dp_rank=chosen.dp_rank,
        cost=costs[i],
        overlap_blocks=chosen.overlap_blocks,
        cached_tokens=min(chosen.overlap_blocks * block_size, max(isl_tokens, 0)),
        costs={c.key: cost for c, cost in zip(eligible, costs, strict=True)},
    )


def _argmin_random_tie(costs: Sequence[float], rng: random.Random) -> int:
    """Index of the minimum; ties broken uniformly (reservoir sampling over the tied minima)."""
    best = math.inf
    chosen = 0
    ties = 0
    for i, c in enumerate(costs):
        if c < best:
            best, chosen, ties = c, i, 1
        elif c == best:
            ties += 1
            if rng.randrange(ties) == 0:
                chosen = i
    return chosen


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

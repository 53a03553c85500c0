"""Selector: the FACTS §4.2 cost, tie-breaking, temperature sampling, busy thresholds."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from dynamo.router.selector import (
    Candidate,
    SelectorConfig,
    candidate_costs,
    is_busy,
    select_worker,
)
from dynamo.runtime.errors import NoInstances, Overloaded

B = 16


def worked_example() -> list[Candidate]:
    # ISL 160 tokens = 10 blocks, no active prefill: raw prefill 10 blocks for everyone
    return [
        Candidate(worker_id=1, overlap_blocks=2, active_decode_blocks=4, new_decode_blocks=6),
        Candidate(worker_id=2, overlap_blocks=5, active_decode_blocks=5, new_decode_blocks=0),
        Candidate(worker_id=3, overlap_blocks=8, active_decode_blocks=9, new_decode_blocks=0),
    ]


def test_worked_example_picks_w2() -> None:
    cfg = SelectorConfig()
    assert candidate_costs(worked_example(), 160, B, cfg) == [18.0, 10.0, 11.0]
    for seed in range(20):
        sel = select_worker(worked_example(), 160, B, cfg, random.Random(seed))
        assert sel.key == (2, 0)
        assert sel.cost == 10.0 and sel.overlap_blocks == 5 and sel.cached_tokens == 80
        assert sel.costs == {(1, 0): 18.0, (2, 0): 10.0, (3, 0): 11.0}


def test_defaults_match_the_reference() -> None:
    cfg = SelectorConfig()
    assert cfg.overlap_score_credit == 1.0 and cfg.prefill_load_scale == 1.0
    assert cfg.temperature == 0.0 and cfg.decode_active_request_weight == 0.0
    assert cfg.overlap_score_credit_decay == 0.0 and cfg.track_prefill_tokens
    assert cfg.active_decode_blocks_threshold is None
    assert cfg.active_prefill_tokens_threshold is None
    assert cfg.active_prefill_tokens_threshold_frac is None


def test_cost_terms() -> None:
    c = Candidate(
        worker_id=1,
        overlap_blocks=3,
        active_prefill_tokens=32,
        active_decode_blocks=7,
        new_decode_blocks=2,
        active_requests=4,
    )
    # (32 + 160)/16 = 12 raw; credit 3 -> 9 prefill; decode 9; requests 0.5*4
    cfg = SelectorConfig(decode_active_request_weight=0.5)
    assert candidate_costs([c], 160, B, cfg) == [9.0 + 9.0 + 2.0]
    assert candidate_costs([c], 160, B, SelectorConfig(prefill_load_scale=2.0)) == [18.0 + 9.0]
    # overlap beyond the prompt never makes the prefill term negative
    big = Candidate(worker_id=1, overlap_blocks=50)
    assert candidate_costs([big], 160, B, SelectorConfig()) == [0.0]
    # decode-only router (prefill untracked): the credit offsets decode load
    dec = SelectorConfig(track_prefill_tokens=False)
    assert candidate_costs([c], 160, B, dec) == [max(0.0, 9.0 - 3.0)]
    no_credit = SelectorConfig(track_prefill_tokens=False, overlap_score_credit=0.0)
    assert candidate_costs([c], 160, B, no_credit) == [9.0]
    with pytest.raises(ValueError):
        candidate_costs([c], 160, 0, SelectorConfig())


def test_credit_decay_penalises_overlap_on_prefill_loaded_workers() -> None:
    idle = Candidate(worker_id=1, overlap_blocks=8, active_prefill_tokens=0)
    loaded = Candidate(worker_id=2, overlap_blocks=8, active_prefill_tokens=160)
    costs = candidate_costs([idle, loaded], 160, B, SelectorConfig(overlap_score_credit_decay=1.0))
    # idle: 10 - 8 = 2; loaded: raw 20, decay 1/(1 + 10/10) = 0.5 -> credit 4 -> 16
    assert costs == [2.0, 16.0]


def test_ties_are_broken_uniformly_at_random() -> None:
    cands = [Candidate(worker_id=w) for w in range(4)] + [
        Candidate(worker_id=9, active_decode_blocks=1)
    ]
    rng = random.Random(0)
    picks = Counter(
        select_worker(cands, 64, B, SelectorConfig(), rng).worker_id for _ in range(4000)
    )
    assert set(picks) == {0, 1, 2, 3}
    for w in range(4):
        assert 850 < picks[w] < 1150  # ~1000 each


def test_temperature_sampling_follows_the_softmax() -> None:
    cands = [
        Candidate(worker_id=1, active_decode_blocks=0),
        Candidate(worker_id=2, active_decode_blocks=5),
        Candidate(worker_id=3, active_decode_blocks=10),
    ]
    t = 0.5
    rng = random.Random(1)
    n = 20000
    picks = Counter(
        select_worker(cands, 16, B, SelectorConfig(temperature=t), rng).worker_id for _ in range(n)
    )
    # costs 1, 6, 11 normalised to 0, 0.5, 1 -> weights exp(0), exp(-1), exp(-2)
    w = [1.0, math.exp(-1.0), math.exp(-2.0)]
    for wid, weight in zip((1, 2, 3), w, strict=True):
        assert abs(picks[wid] / n - weight / sum(w)) < 0.02
    # a per-request override back to 0 is greedy; equal costs sample uniformly
    greedy = select_worker(cands, 16, B, SelectorConfig(temperature=t), rng, temperature=0.0)
    assert greedy.worker_id == 1
    same = [Candidate(worker_id=w) for w in (1, 2)]
    uni = Counter(
        select_worker(same, 16, B, SelectorConfig(temperature=1.0), rng).worker_id
        for _ in range(2000)
    )
    assert 850 < uni[1] < 1150


def test_busy_thresholds_exclude_and_all_busy_is_overloaded() -> None:
    cfg = SelectorConfig(active_decode_blocks_threshold=0.5)
    full = Candidate(worker_id=1, active_decode_blocks=51, total_kv_blocks=100)
    edge = Candidate(worker_id=2, active_decode_blocks=50, total_kv_blocks=100)  # not above
    unknown = Candidate(worker_id=3, active_decode_blocks=10_000)  # capacity unknown
    assert is_busy(full, cfg) and not is_busy(edge, cfg) and not is_busy(unknown, cfg)
    rng = random.Random(0)
    pick = select_worker([full, edge], 16, B, cfg, rng)
    assert pick.worker_id == 2 and (1, 0) not in pick.costs
    with pytest.raises(Overloaded, match="busy"):
        select_worker([full], 16, B, cfg, rng)

    pcfg = SelectorConfig(active_prefill_tokens_threshold=1000)
    hot = Candidate(worker_id=4, active_prefill_tokens=1001)
    assert is_busy(hot, pcfg) and not is_busy(
        Candidate(worker_id=5, active_prefill_tokens=1000), pcfg
    )
    fcfg = SelectorConfig(active_prefill_tokens_threshold_frac=0.5)
    frac = Candidate(worker_id=6, active_prefill_tokens=600, max_num_batched_tokens=1000)
    assert is_busy(frac, fcfg) and not is_busy(
        Candidate(worker_id=7, active_prefill_tokens=600), fcfg
    )
    both = SelectorConfig(
        active_prefill_tokens_threshold=10_000, active_prefill_tokens_threshold_frac=0.5
    )
    assert is_busy(frac, both)  # OR'ed
    hotter = Candidate(worker_id=8, active_prefill_tokens=10_001)  # above the absolute one
    with pytest.raises(Overloaded):
        select_worker([hotter, frac], 16, B, both, rng)
    assert select_worker([hot, frac], 16, B, both, rng).worker_id == 4


def test_no_candidates_and_bad_config() -> None:
    with pytest.raises(NoInstances):
        select_worker([], 16, B, SelectorConfig(), random.Random(0))
    with pytest.raises(ValueError):
        SelectorConfig(temperature=-1)
    with pytest.raises(ValueError):
        SelectorConfig(active_decode_blocks_threshold=1.5)
    with pytest.raises(ValueError):
        select_worker(
            [Candidate(worker_id=1)], 16, B, SelectorConfig(), random.Random(0), temperature=-1
        )


def test_every_selector_knob_has_a_flag() -> None:
    import argparse
    import dataclasses

    from dynamo.router.config import KVRouterSettings

    parser = argparse.ArgumentParser()
    KVRouterSettings.add_arguments(parser)
    args = parser.parse_args(
        [
            "--router-temperature=0.5",
            "--router-kv-overlap-score-credit=0.5",
            "--kv-overlap-score-weight=2",
            "--router-decode-active-request-weight=0.25",
            "--router-kv-overlap-score-credit-decay=1.5",
            "--no-router-track-prefill-tokens",
            "--active-decode-blocks-threshold=0.9",
            "--active-prefill-tokens-threshold=1000",
            "--active-prefill-tokens-threshold-frac=0.75",
        ]
    )
    cfg = KVRouterSettings.from_args(args).selector_config()
    default = SelectorConfig()
    unchanged = [
        f.name
        for f in dataclasses.fields(SelectorConfig)
        if getattr(cfg, f.name) == getattr(default, f.name)
    ]
    assert unchanged == [], "a selector knob no flag can set"

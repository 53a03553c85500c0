"""nvext ``timing``: the reference's TimingInfo fields from the frontend's own moments."""

from __future__ import annotations

import time

import msgspec

from dynamo.frontend.timing import timing_info


def test_fields_from_given_moments() -> None:
    t = timing_info(
        started=100.0,
        dispatched_at=100.002,
        first_token_at=100.0125,
        prompt_tokens=64,
        cached_tokens=16,
        now=100.5,
    )
    assert t.prefill_wait_time_ms == 2.0
    assert t.prefill_time_ms == 10.5
    assert t.ttft_ms == 12.5
    assert t.total_time_ms == 500.0
    assert t.kv_hit_rate == 0.25
    # received = now's wall clock minus the 0.5 s that passed since
    assert abs(t.request_received_ms - (time.time() - 0.5) * 1000) < 1000
    assert set(msgspec.to_builtins(t)) == {
        "request_received_ms",
        "prefill_wait_time_ms",
        "prefill_time_ms",
        "ttft_ms",
        "total_time_ms",
        "kv_hit_rate",
    }


def test_moments_that_never_came_are_left_out() -> None:
    t = timing_info(
        started=1.0, dispatched_at=None, first_token_at=None, prompt_tokens=0, cached_tokens=None
    )
    assert set(msgspec.to_builtins(t)) == {"request_received_ms", "total_time_ms"}

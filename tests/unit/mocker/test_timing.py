"""The mocker's timing model against the reference measurements (FACTS §6.4), on simulated time."""

from __future__ import annotations

import asyncio

import pytest
from mocker_sim import make_request, scheduler, simulate

from dynamo.mocker.timing import RealClock, TimingModel, VirtualClock, decode_ms, prefill_ms
from dynamo.protocol.disagg import DisaggregatedParams

REL = 1e-3  # the tolerance: 0.1 %
TOTAL = 16384 * 64


def P(t: int) -> float:  # noqa: N802 - the formula's name in FACTS
    """Independent transcription of the reference prefill polynomial."""
    return 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142 if t else 0.0


def D(ctx: int) -> float:  # noqa: N802
    u = ctx / TOTAL
    return max(1.0, -25.74 * u * u + 54.01 * u + 5.74)


def approx(x: float) -> object:
    return pytest.approx(x, rel=REL)


# -- the formulas --------------------------------------------------------------------------
def test_formulas_match_reference_measurements() -> None:
    assert prefill_ms(1024) == pytest.approx(32.490712, abs=1e-6)
    assert prefill_ms(2048) == pytest.approx(49.362902, abs=1e-6)
    assert prefill_ms(8192) + prefill_ms(1808) == pytest.approx(214.466186, abs=1e-6)
    assert decode_ms(1025, TOTAL) == pytest.approx(5.792771, abs=1e-6)
    assert decode_ms(1027, TOTAL) == pytest.approx(5.792874, abs=1e-6)
    assert prefill_ms(0) == 0.0


def test_decode_floor_and_empty_pool() -> None:
    assert decode_ms(10 * TOTAL, TOTAL) == 1.0  # the polynomial goes negative: floored at 1 ms
    assert decode_ms(0, 0) == pytest.approx(-25.74 + 54.01 + 5.74)  # no capacity: u = 1


def test_timing_model_speedups_and_transfer() -> None:
    base = TimingModel(total_kv_tokens=TOTAL)
    assert base.pass_seconds(1024, 2000, 1) == pytest.approx((P(1024) + D(2000)) / 1000)
    assert base.pass_seconds(1024, 0, 0) == pytest.approx(P(1024) / 1000)  # no decode set
    fast = TimingModel(total_kv_tokens=TOTAL, speedup_ratio=2.0, decode_speedup_ratio=4.0)
    assert fast.pass_seconds(1024, 2000, 1) == pytest.approx((P(1024) + D(2000) / 4) / 2000)
    assert TimingModel(total_kv_tokens=TOTAL, speedup_ratio=0).pass_seconds(1024, 5, 1) == 0.0
    bw = TimingModel(total_kv_tokens=TOTAL, kv_transfer_bandwidth=64, kv_bytes_per_token=131072)
    assert bw.transfer_seconds(1024) == pytest.approx(1024 * 131072 / 64e9)
    assert TimingModel(total_kv_tokens=TOTAL, kv_transfer_bandwidth=64).transfer_seconds(9) == 0


# -- whole passes on simulated time ----------------------------------------------------------
def test_pass_seconds_is_the_formulas_bit_for_bit() -> None:
    """pass_seconds is prefill_ms / decode_ms: the same floats, not merely close ones
    (the replay's records are compared byte for byte)."""
    for total, speedup, decode_speedup in ((TOTAL, 1.0, 1.0), (8192, 3.0, 0.7), (0, 2.0, 1.0)):
        model = TimingModel(total, speedup_ratio=speedup, decode_speedup_ratio=decode_speedup)
        for prefill in (0, 1, 17, 1152, 8192):
            for ctx in (0, 5, 900, 4000, 8192, TOTAL):
                for decodes in (0, 1, 8):
                    want = prefill_ms(prefill)
                    if decodes:
                        want += decode_ms(ctx, total) / decode_speedup
                    got = model.pass_seconds(prefill, ctx, decodes)
                    assert got == want / speedup / 1000.0, (total, prefill, ctx, decodes)


def test_single_request_ttft_and_itl() -> None:
    tr = simulate(scheduler(), [(0.0, "a", make_request(1024, 4))])["a"]
    assert tr.ttft_ms == approx(32.4907)
    assert tr.itls_ms == [approx(D(1025)), approx(D(1026)), approx(D(1027))]
    assert len(tr.tokens) == 4


def test_two_simultaneous_prompts_share_one_prefill_pass() -> None:
    reqs = [(0.0, "a", make_request(1024)), (0.0, "b", make_request(1024, start=5000))]
    traces = simulate(scheduler(), reqs)
    for tr in traces.values():
        assert tr.ttft_ms == approx(49.3629)
        assert tr.itls_ms[0] == approx(D(2050))


def test_long_prompt_is_chunked_by_the_budget() -> None:
    tr = simulate(scheduler(), [(0.0, "a", make_request(10000, 2))])["a"]
    assert tr.ttft_ms == approx(214.466)


def test_prompt_arriving_mid_decode_pays_prefill_plus_decode() -> None:
    # A decodes alone; B arrives just as A's context reaches 1030 (after 6 tokens).
    arrival = (P(1024) + sum(D(c) for c in range(1025, 1030))) / 1000 - 1e-9
    reqs = [(0.0, "a", make_request(1024, 20)), (arrival, "b", make_request(1024, start=9000))]
    traces = simulate(scheduler(), reqs)
    assert traces["b"].ttft_ms == approx(P(1024) + D(1030))
    assert traces["a"].itls_ms[5] == approx(P(1024) + D(1030))  # A's pass included B's prefill


def test_speedup_halves_everything_and_decode_speedup_only_itl() -> None:
    base = simulate(scheduler(), [(0.0, "a", make_request(1024, 4))])["a"]
    fast = simulate(scheduler(speedup_ratio=2.0), [(0.0, "a", make_request(1024, 4))])["a"]
    assert fast.ttft_ms == approx(base.ttft_ms / 2)
    assert fast.itls_ms == [approx(x / 2) for x in base.itls_ms]
    dec = simulate(scheduler(decode_speedup_ratio=2.0), [(0.0, "a", make_request(1024, 4))])["a"]
    assert dec.ttft_ms == approx(base.ttft_ms)
    assert dec.itls_ms == [approx(x / 2) for x in base.itls_ms]


def test_speedup_zero_takes_no_time() -> None:
    tr = simulate(scheduler(speedup_ratio=0.0), [(0.0, "a", make_request(1024, 8))])["a"]
    assert tr.times == [0.0] * 8


@pytest.mark.parametrize(
    ("bandwidth", "bytes_per_token", "expected_ms"),
    [(None, None, 38.2834), (64.0, 131072, 40.3806), (10.0, 131072, 51.7052)],
)
def test_disaggregated_ttft(
    bandwidth: float | None, bytes_per_token: int | None, expected_ms: float
) -> None:
    prefill = scheduler(disaggregation_mode="prefill")
    p = simulate(prefill, [(0.0, "r", make_request(1024, 50))])["r"]
    assert len(p.tokens) == 1  # the prefill worker emits exactly one token
    handoff = DisaggregatedParams(prefill_worker_id=1, num_prompt_tokens=1024)
    decode = scheduler(
        disaggregation_mode="decode",
        kv_transfer_bandwidth=bandwidth,
        kv_bytes_per_token=bytes_per_token,
    )
    # The decode request is sent when the prefill worker finished.
    req = make_request(1024, 3, prefill_result=handoff)
    d = simulate(decode, [(p.times[0], "r", req)])["r"]
    assert (d.times[0] - p.arrival) * 1000 == approx(expected_ms)
    assert d.itls_ms[0] == approx(D(1025))
    # No local prefill (the prompt's KV was transferred); the cached tokens reported are the
    # prefill worker's prefix hit (the handoff says none), not the transferred prompt.
    assert d.cached_tokens == 0
    again = make_request(
        1024,
        3,
        prefill_result=DisaggregatedParams(
            prefill_worker_id=1, num_prompt_tokens=1024, num_cached_tokens=512
        ),
    )
    assert (
        simulate(scheduler(disaggregation_mode="decode"), [(0.0, "s", again)])["s"].cached_tokens
        == 512
    )


# -- clocks ----------------------------------------------------------------------------------
async def test_virtual_clock_overlaps_concurrent_sleepers() -> None:
    clock = VirtualClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    await asyncio.gather(sleeper("slow", 2.0), sleeper("fast", 1.0), sleeper("mid", 1.5))
    assert woke == [("fast", 1.0), ("mid", 1.5), ("slow", 2.0)]
    assert clock.now() == 2.0  # overlapped, not 4.5


async def test_virtual_clock_cancelled_sleeper_does_not_move_time() -> None:
    clock = VirtualClock()
    task = asyncio.create_task(clock.sleep(100.0), name="doomed-sleeper")
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await clock.sleep(1.0)
    assert clock.now() == 1.0


def test_virtual_clock_advance() -> None:
    clock = VirtualClock(5.0)
    clock.advance(1.0)
    clock.advance_to(3.0)  # the past: no-op
    assert clock.now() == 6.0
    with pytest.raises(ValueError):
        clock.advance(-1)


async def test_real_clock_sleeps() -> None:
    clock = RealClock()
    t0 = clock.now()
    await clock.sleep(0.01)
    assert clock.now() - t0 >= 0.009

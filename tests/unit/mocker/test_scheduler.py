"""The vLLM-v1-style scheduler: prefix caching, budgets, preemption, rejection, cancellation."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mocker_sim import BlockSetSubscriber, make_request, scheduler, simulate

from dynamo.engine_core.sequence import sequence_from_request
from dynamo.mocker.simulator import MockerScheduler as Scheduler
from dynamo.mocker.timing import prefill_ms
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.output import FinishReason
from dynamo.runtime.errors import InvalidArgument


def assert_empty(s: Scheduler) -> None:
    """No leaks: nothing queued, no block active."""
    s.check_invariants()
    assert not s.has_work and s.num_running == 0 and s.num_waiting == 0
    assert s.kv.num_active_blocks == 0


# -- prefix caching --------------------------------------------------------------------------
def test_identical_prompts_hit_the_prefix_cache() -> None:
    s, sub = scheduler(), BlockSetSubscriber()
    first = simulate(s, [(0.0, "a", make_request(1000, 4))], subscriber=sub)["a"]
    second = simulate(s, [(0.0, "b", make_request(1000, 4))], subscriber=sub)["b"]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 15 * 64  # 15 full blocks; the 40-token tail is recomputed
    assert second.ttft_ms == pytest.approx(prefill_ms(40), rel=1e-3)
    assert_empty(s)


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    s = scheduler()
    simulate(s, [(0.0, "a", make_request(1024, 2))])
    tr = simulate(s, [(0.0, "b", make_request(1024, 2))])["b"]
    assert tr.cached_tokens == 1023
    assert tr.ttft_ms == pytest.approx(prefill_ms(1), rel=1e-3)


def test_prefix_caching_off_never_hits_and_publishes_nothing() -> None:
    s, sub = scheduler(enable_prefix_caching=False), BlockSetSubscriber()
    simulate(s, [(0.0, "a", make_request(1000, 70))], subscriber=sub)
    tr = simulate(s, [(0.0, "b", make_request(1000, 4))], subscriber=sub)["b"]
    assert tr.cached_tokens == 0 and sub.next_id == 0
    assert_empty(s)


def test_decode_blocks_are_promoted_and_shareable() -> None:
    # 60-token prompt + 68 generated tokens: the tail block fills during decode and is stored.
    s, sub = scheduler(block_size=16, num_gpu_blocks=64), BlockSetSubscriber()
    tr = simulate(s, [(0.0, "a", make_request(60, 68))], subscriber=sub)["a"]
    assert len(sub.blocks) == (60 + 68 - 1) // 16
    follow_up = make_request(list(range(1, 61)) + tr.tokens, 1)
    again = simulate(s, [(0.0, "b", follow_up)], subscriber=sub)["b"]
    assert again.cached_tokens == 7 * 16  # every block computed by the first request
    assert_empty(s)


def test_lru_eviction_keeps_recently_used_prefixes() -> None:
    s = scheduler(block_size=16, num_gpu_blocks=8)
    for i, name in enumerate(("x", "y", "x2", "z")):
        start = 1 if name.startswith("x") else 1000 * (i + 1)
        simulate(s, [(0.0, name, make_request(64, 1, start=start))])
    # x (used twice, most recently before z) survives; y, least recently used, was evicted.
    assert s.kv.num_cached_prefix(s.add_request(make_request(64, 1), "x3", 0.0).block_hashes) == 4
    y = s.add_request(make_request(64, 1, start=2000), "y2", 0.0)
    assert s.kv.num_cached_prefix(y.block_hashes) < 4


# -- budgets and limits ----------------------------------------------------------------------
def test_without_chunked_prefill_a_prompt_waits_for_enough_budget() -> None:
    s = scheduler(enable_chunked_prefill=False)
    reqs = [(0.0, "a", make_request(5000, 2)), (0.0, "b", make_request(5000, 2, start=9000))]
    t = simulate(s, reqs)
    assert t["a"].ttft_ms == pytest.approx(prefill_ms(5000), rel=1e-3)
    assert t["b"].times[0] > t["a"].times[0]  # not chunked into the first pass
    with pytest.raises(InvalidArgument):
        s.add_request(make_request(9000), "huge", 0.0)


def test_max_num_seqs_limits_the_running_set() -> None:
    s = scheduler(max_num_seqs=2)
    reqs = [(0.0, n, make_request(100, 5, start=1000 * i)) for i, n in enumerate("abc")]
    t = simulate(s, reqs)
    assert t["c"].times[0] > t["a"].times[-1]  # c started only after a (or b) finished


@pytest.mark.parametrize(
    ("tokens", "max_tokens", "overrides"),
    [
        (0, 4, {}),  # empty prompt
        (100, 0, {}),  # max_tokens < 1
        (100, 200, {"context_length": 256}),  # prompt + max_tokens > context length
        (256, None, {"context_length": 256}),  # no room at all
        (100, 100, {"num_gpu_blocks": 3, "block_size": 64}),  # can never fit in the pool
    ],
)
def test_requests_that_can_never_run_are_rejected(
    tokens: int, max_tokens: int | None, overrides: dict[str, int]
) -> None:
    s = scheduler(**overrides)
    with pytest.raises(InvalidArgument):
        s.add_request(make_request(tokens, max_tokens), "r", 0.0)
    assert_empty(s)


def test_min_tokens_above_max_tokens_is_rejected_and_ids_are_unique() -> None:
    s = scheduler()
    with pytest.raises(InvalidArgument):
        s.add_request(make_request(10, 2, min_tokens=3), "r", 0.0)
    s.add_request(make_request(10, 2), "r", 0.0)
    with pytest.raises(ValueError):
        s.add_request(make_request(10, 2), "r", 0.0)


# -- output tokens ---------------------------------------------------------------------------
def test_output_tokens_are_seeded_and_never_special() -> None:
    s = scheduler(vocab_size=10, special_token_ids=frozenset(range(8)))
    t = simulate(s, [(0.0, "a", make_request(10, 30, eos_token_ids=[8]))])
    assert t["a"].tokens == [9] * 30  # 0-7 special, 8 is EOS: only 9 is left
    assert t["a"].finish is FinishReason.LENGTH
    a1 = simulate(scheduler(), [(0.0, "a", make_request(10, 16))])["a"].tokens
    a2 = simulate(scheduler(), [(0.0, "a", make_request(10, 16))])["a"].tokens
    b = simulate(scheduler(), [(0.0, "b", make_request(10, 16))])["b"].tokens
    assert a1 == a2 and a1 != b
    assert all(0 <= x < 32000 for x in a1)


def test_stop_tokens_respect_min_tokens() -> None:
    s = scheduler(vocab_size=4, special_token_ids=frozenset({0}))
    stop = [1, 2, 3]  # every sampled token is a stop token
    t = simulate(s, [(0.0, "a", make_request(10, 20, stop_token_ids=stop))])
    assert len(t["a"].tokens) == 1 and t["a"].finish is FinishReason.STOP
    t = simulate(s, [(0.0, "b", make_request(10, 20, stop_token_ids=stop, min_tokens=3))])
    assert len(t["b"].tokens) == 3 and t["b"].finish is FinishReason.STOP


# -- preemption and cancellation ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["lifo", "fifo"])
def test_preemption_under_kv_pressure_completes_every_request(mode: str) -> None:
    s = scheduler(block_size=16, num_gpu_blocks=40, preemption_mode=mode)
    sub = BlockSetSubscriber()
    rng = random.Random(7)
    reqs = [
        (rng.random() * 0.05, f"r{i}", make_request(rng.randint(20, 200), rng.randint(50, 300)))
        for i in range(30)
    ]
    preempted: list[int] = []

    def count(sched: Scheduler, now: float) -> None:
        preempted.append(sum(seq.num_preemptions for seq in sched._running))

    traces = simulate(s, reqs, subscriber=sub, on_step=count)
    assert max(preempted) > 0, "the scenario must actually preempt"
    for _, rid, req in reqs:
        tr = traces[rid]
        assert tr.finish is FinishReason.LENGTH
        assert len(tr.tokens) == req.stop.max_tokens
    assert_empty(s)


def test_cancelling_1000_random_requests_leaves_no_active_block() -> None:
    s = scheduler(block_size=16, num_gpu_blocks=200, max_num_batched_tokens=512)
    sub = BlockSetSubscriber()
    rng = random.Random(11)
    shared = list(range(1, 65))
    reqs = []
    for i in range(1000):
        prompt = shared[: rng.randint(0, 64)] + [rng.randint(1, 30000) for _ in range(30)]
        reqs.append((i * 1e-4, f"r{i}", make_request(prompt, rng.randint(1, 40))))
    cancelled: set[str] = set()

    def cancel_some(sched: Scheduler, now: float) -> None:
        live = [q.request_id for q in (*sched._waiting, *sched._running)]
        for rid in rng.sample(live, k=min(len(live), rng.randint(0, 3))):
            assert sched.abort(rid)
            cancelled.add(rid)

    traces = simulate(s, reqs, subscriber=sub, on_step=cancel_some)
    assert len(cancelled) > 300
    assert all(traces[r].finish is None for r in cancelled)
    assert not s.abort("r0")  # unknown now: finished or already aborted
    assert_empty(s)
    assert sub.blocks == s.kv.cached_blocks()


def test_abort_of_a_waiting_request() -> None:
    s = scheduler(max_num_seqs=1)
    s.add_request(make_request(10, 5), "a", 0.0)
    s.add_request(make_request(10, 5), "b", 0.0)
    s.step(0.0)
    assert s.num_waiting == 1 and s.abort("b") and s.num_waiting == 0
    assert s.abort("a")
    assert_empty(s)


# -- disaggregation and load -----------------------------------------------------------------
def test_decode_worker_without_handoff_prefills_locally() -> None:
    t = simulate(scheduler(disaggregation_mode="decode"), [(0.0, "a", make_request(1024, 2))])
    assert t["a"].ttft_ms == pytest.approx(32.4907, rel=1e-3) and t["a"].cached_tokens == 0


def test_decode_side_request_waits_for_its_transfer() -> None:
    s = scheduler(disaggregation_mode="decode", kv_bytes_per_token=131072)
    handoff = DisaggregatedParams(prefill_worker_id=7, num_prompt_tokens=1024)
    s.add_request(make_request(1024, 2, prefill_result=handoff), "a", 0.0)
    out = s.step(0.0)
    assert out.is_empty and s.num_running == 1 and s.kv.num_active_blocks == 16
    ready = s.next_ready_at()
    assert ready is not None
    assert ready == pytest.approx(1024 * 131072 / 64e9)
    assert s.step(ready).num_decodes == 1


def test_load_metrics() -> None:
    s = scheduler(num_gpu_blocks=100, block_size=16, max_num_seqs=1)
    s.add_request(make_request(40, 5), "a", 0.0)
    s.add_request(make_request(40, 5, start=100), "b", 0.0)
    s.step(0.0)
    load = s.load(worker_id=42)
    assert (load.worker_id, load.dp_rank, load.total_blocks) == (42, 0, 100)
    assert (load.num_running, load.num_waiting, load.active_decode_blocks) == (1, 1, 3)
    assert load.kv_usage == pytest.approx(0.03)


def test_check_invariants_detects_a_leak() -> None:
    s = scheduler()
    s.add_request(make_request(100, 5), "a", 0.0)
    s.step(0.0)
    s.kv.allocate_unique(1)  # a block nobody holds
    with pytest.raises(AssertionError):
        s.check_invariants()


# -- fuzzing the whole policy ----------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 4, 16]),
    num_blocks=st.integers(8, 64),
    budget=st.integers(1, 128),
    max_num_seqs=st.integers(1, 8),
    caching=st.booleans(),
    chunked=st.booleans(),
    mode=st.sampled_from(["lifo", "fifo"]),
    requests=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(1, 30), st.floats(0, 0.2)),
        min_size=1,
        max_size=25,
    ),
    abort_seed=st.integers(0, 3),
)
def test_random_workloads_keep_every_invariant(
    block_size: int,
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    caching: bool,
    chunked: bool,
    mode: str,
    requests: list[tuple[int, int, int, float]],
    abort_seed: int,
) -> None:
    s = scheduler(
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
    )
    rng = random.Random(abort_seed)
    arrivals = []
    for i, (prefix, isl, osl, t) in enumerate(requests):
        req = make_request(
            [prefix + 1] * (isl // 2) + list(range(100 * i, 100 * i + isl - isl // 2)), osl
        )
        try:
            sequence_from_request(s.config, req, "probe", 0.0)
        except InvalidArgument:
            continue  # can never run here: add_request would reject it
        arrivals.append((t, f"r{i}", req))

    aborted: set[str] = set()

    def maybe_abort(sched: Scheduler, now: float) -> None:
        if abort_seed and rng.random() < 0.1:
            live = [q.request_id for q in (*sched._waiting, *sched._running)]
            if live:
                victim = rng.choice(live)
                assert sched.abort(victim)
                aborted.add(victim)

    traces = simulate(s, arrivals, subscriber=BlockSetSubscriber(), on_step=maybe_abort)
    for _, rid, req in arrivals:
        if rid not in aborted:
            assert traces[rid].finish is FinishReason.LENGTH
            assert len(traces[rid].tokens) == req.stop.max_tokens
    assert_empty(s)

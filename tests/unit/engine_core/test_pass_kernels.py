"""engine_core/_pass.c and its fallback (``_pass_fallback.py``): the per-entry loops of a pass.

The fallback is the reference: it calls ``Sequence.append_token`` / ``finish_after`` and the
sampler's formula as they were written in Python. Each case runs both implementations on twin
sequences (same construction) and compares every output and every field the loops touch; the
native module is skipped where it is not built.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from xxhash import xxh3_64_intdigest

from dynamo.engine_core import _pass_fallback
from dynamo.engine_core.sequence import Sequence, SequenceStatus, sequence_from_request
from dynamo.protocol.output import FinishReason
from dynamo.protocol.request import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo.router.hashing import local_block_hashes, sequence_hashes

BS = 4


class Limits:
    block_size = BS
    num_gpu_blocks = 10_000
    max_num_seqs = 64
    max_num_batched_tokens = 4096
    enable_prefix_caching = True
    enable_chunked_prefill = True
    preemption_mode = "lifo"
    disaggregation_mode = "agg"
    max_model_len = 100_000
    total_kv_tokens = num_gpu_blocks * block_size


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.engine_core._pass")


def make(i: int, rng: random.Random) -> Sequence:
    """A running sequence of random shape (its twin: the same call with an equal ``rng``)."""
    prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 23))]
    stop = StopConditions(
        max_tokens=rng.randrange(2, 9),
        min_tokens=rng.choice([None, 0, 2]),
        stop_token_ids=rng.sample(range(50), rng.randrange(0, 4)),
        ignore_eos=rng.random() < 0.5,
    )
    request = PreprocessedRequest(
        model="m",
        token_ids=prompt,
        stop=stop,
        eos_token_ids=[3],
        sampling=SamplingOptions(seed=rng.choice([None, rng.randrange(1 << 64)])),
    )
    seq = sequence_from_request(Limits(), request, f"r{i}", 0.0)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = rng.randrange(0, len(prompt))
    seq.prefill_end = len(prompt)
    return seq


def fields(seq: Sequence) -> tuple[Any, ...]:
    return (
        list(seq.tokens),
        list(seq.local_hashes),
        list(seq.block_hashes),
        seq.num_computed_tokens,
        seq.status,
        seq.finish_reason,
    )


def test_sample_tokens_matches_the_fallback(native: ModuleType) -> None:
    rng = random.Random(7)
    for vocab, excluded in [(50, frozenset()), (50, frozenset(range(40))), (2**40, frozenset())]:
        seqs = [make(i, rng) for i in range(40)]
        entries = [(s, rng.randrange(0, 30)) for s in seqs]
        want = _pass_fallback.sample_tokens(entries, vocab, excluded)
        assert native.sample_tokens(entries, vocab, excluded) == want
        assert None in want and any(t is not None for t in want)
        assert all(t is None or (0 <= t < vocab and t not in excluded) for t in want)
        for (seq, _), t in zip(entries, want, strict=True):
            assert t is None or t not in seq.banned_token_ids


def test_sample_tokens_depends_only_on_seed_and_position(native: ModuleType) -> None:
    a, b = make(0, random.Random(1)), make(0, random.Random(1))
    b.num_computed_tokens = a.num_computed_tokens = a.num_tokens - 1
    first = native.sample_tokens([(a, 1)], 1000, frozenset())
    assert native.sample_tokens([(b, 1)], 1000, frozenset()) == first
    b.tokens.append(5)
    b.num_computed_tokens += 1
    assert native.sample_tokens([(b, 1)], 1000, frozenset()) != first  # the next position


def run_both(
    native: ModuleType, seed: int, count: int, *, caching: bool = True
) -> tuple[Any, Any, list[list[Sequence]]]:
    outs, twins, promoted = [], [], []
    for impl in (_pass_fallback, native):
        rng = random.Random(seed)
        seqs = [make(i, rng) for i in range(count)]
        for s in seqs[::5]:
            s.status = SequenceStatus.FINISHED  # aborted while the pass ran: skipped
        entries = [(s, rng.randrange(1, 6)) for s in seqs]
        sampled: list[int | None] = [rng.choice([rng.randrange(50), 3]) for _ in seqs]
        calls: list[Sequence] = []
        for s in seqs[2::4]:
            s.max_tokens = 1  # the next token is the last one
        for s in seqs[1::3]:
            s.unique_blocks = [1]  # a private tail: promote is asked for once it is computed
        outs.append(
            impl.advance(
                entries,
                sampled,
                BS,
                caching,
                SequenceStatus.RUNNING,
                SequenceStatus.FINISHED,
                FinishReason.LENGTH,
                FinishReason.STOP,
                calls.append,
                xxh3_64_intdigest,
            )
        )
        twins.append(seqs)
        promoted.append([s.request_id for s in calls])
    assert promoted[0] == promoted[1]
    assert bool(promoted[0]) == caching
    return outs[0], outs[1], twins


@pytest.mark.parametrize("caching", [True, False])
def test_advance_matches_the_fallback(native: ModuleType, caching: bool) -> None:
    reasons = set()
    for seed in range(30):
        want, got, (a, b) = run_both(native, seed, 25, caching=caching)
        assert [(s.request_id, t) for s, t in got[0]] == [(s.request_id, t) for s, t in want[0]]
        assert [s.request_id for s in got[1]] == [s.request_id for s in want[1]]
        assert [fields(s) for s in b] == [fields(s) for s in a]
        reasons |= {s.finish_reason for s in want[1]}
    assert reasons == {FinishReason.LENGTH, FinishReason.STOP}  # both stop rules were exercised


def test_advance_hashes_completed_blocks_as_the_router_does(native: ModuleType) -> None:
    seq = make(0, random.Random(3))
    seq.tokens[:] = list(range(7))
    seq.local_hashes = local_block_hashes(seq.tokens, BS)
    seq.block_hashes = sequence_hashes(seq.local_hashes)
    seq.num_computed_tokens, seq.max_tokens, seq.stop_token_ids = 6, 100, frozenset()
    _call(native, [(seq, 1)], [41])
    assert seq.tokens == [*range(7), 41]
    assert seq.local_hashes == local_block_hashes(seq.tokens, BS)
    assert seq.block_hashes == sequence_hashes(seq.local_hashes)


def _call(impl: ModuleType, entries: list[tuple[Sequence, int]], sampled: list[int | None]) -> Any:
    promote: Callable[[Sequence], None] = lambda s: None  # noqa: E731
    return impl.advance(
        entries,
        sampled,
        BS,
        True,
        SequenceStatus.RUNNING,
        SequenceStatus.FINISHED,
        FinishReason.LENGTH,
        FinishReason.STOP,
        promote,
        xxh3_64_intdigest,
    )


@pytest.mark.parametrize("impl", ["fallback", "native"])
def test_advance_refuses_a_missing_token_and_a_length_mismatch(
    native: ModuleType, impl: str
) -> None:
    module = native if impl == "native" else _pass_fallback
    seq = make(0, random.Random(4))
    seq.num_computed_tokens = seq.num_tokens - 1
    with pytest.raises(ValueError, match="no token sampled for 'r0'"):
        _call(module, [(seq, 1)], [None])
    with pytest.raises(ValueError, match="one item per batch entry"):
        _call(module, [(seq, 1)], [])


def running_twins(seed: int, count: int) -> list[list[Sequence]]:
    """Twin running lists: prefills, decodes (some at a block boundary, so they must grow) and
    decode-side sequences waiting for their KV transfer."""
    out = []
    for _ in range(2):
        rng = random.Random(seed)
        seqs = [make(i, rng) for i in range(count)]
        for s in seqs:
            if rng.random() < 0.6:  # a decode: its KV is computed up to its last token
                s.num_computed_tokens = s.prefill_end = s.num_tokens - 1
            held = -(-s.num_tokens // BS) - rng.choice([0, 0, 1])  # short of one: must grow
            s.unique_blocks = list(range(max(0, held)))
            if rng.random() < 0.2:
                s.pending_transfer, s.ready_at = True, rng.choice([0.5, 2.0])
        out.append(seqs)
    return out


def test_plan_running_matches_the_fallback(native: ModuleType) -> None:
    grows = skipped = 0
    for seed in range(40):
        a, b = running_twins(seed, 12)
        budget = random.Random(seed).choice([3, 20, 200])
        results = []
        for impl, seqs in ((_pass_fallback, a), (native, b)):
            scheduled: dict[int, tuple[Sequence, int]] = {}
            i, left, stops = 0, budget, []
            while True:  # walk it all, as the scheduler does, without growing anything
                i, left, grow = impl.plan_running(seqs, i, left, 1.0, BS, scheduled)
                stops.append((i, left, grow))
                if not grow:
                    break
                i += 1
            plan = [(s.request_id, n) for s, n in scheduled.values()]
            results.append((stops, plan, [s.pending_transfer for s in seqs]))
        assert results[0] == results[1]
        grows += len(results[0][0]) - 1
        skipped += sum(results[0][2])
    assert grows > 20 and skipped > 5  # both exits were exercised

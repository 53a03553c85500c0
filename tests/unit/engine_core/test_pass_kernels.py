"""engine_core/_pass.c and its fallback (``_pass_fallback.py``): the scheduler pass and the
mocker's sampler.

The fallback is the reference: it is the scheduler's policy as it was written in Python
(``Sequence.append_token`` / ``finish_after``, the sampler's formula). Each case runs both
implementations on twins (same construction, same random operations: admissions, aborts,
passes, under block pressure that preempts, with and without prefix caching and chunked
prefill, LIFO and FIFO preemption, decode-side transfers) and compares every output, every KV
event and every field of every sequence; the native module is skipped where it is not built.
"""

from __future__ import annotations

import dataclasses
import random
from types import ModuleType
from typing import Any

import msgspec
import pytest

from dynamo.engine_core import _kv_fallback, _pass_fallback, scheduler
from dynamo.engine_core.scheduler import Scheduler
from dynamo.engine_core.sequence import Sequence, SequenceStatus, sequence_from_request
from dynamo.protocol import kv_raw
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.output import FinishReason
from dynamo.protocol.request import PreprocessedRequest, SamplingOptions, StopConditions

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
        list(seq.prompt),
        list(seq.output),
        list(seq.local_hashes),
        list(seq.block_hashes),
        seq.num_computed_tokens,
        seq.status,
        seq.finish_reason,
    )


def test_sample_tokens_matches_the_fallback(native: ModuleType) -> None:
    rng = random.Random(7)
    few = frozenset(range(10, 30))  # the mocker's case: its special ids, the same set each pass
    cases: list[tuple[int, Any]] = [
        (50, frozenset()),
        (50, frozenset(range(40))),  # more than the native pass keeps as numbers
        (2**40, frozenset()),
        (50, few),
        (50, few),  # the same set again (held by the native pass)
        (50, frozenset(range(10, 30))),  # an equal one
        (50, frozenset({True, 4.0, 9, -1})),  # not all exact non-negative ints: the set is asked
        (50, set(range(10, 30))),  # not frozen: the set is asked
    ]
    for vocab, excluded in cases:
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
    b.output.append(5)
    b.num_computed_tokens += 1
    assert native.sample_tokens([(b, 1)], 1000, frozenset()) != first  # the next position


@dataclasses.dataclass(frozen=True)
class Shape:
    """The limits of one random scheduler (``SchedulerLimits``)."""

    block_size: int = BS
    num_gpu_blocks: int = 40
    max_num_seqs: int = 6
    max_num_batched_tokens: int = 24
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "lifo"
    disaggregation_mode: str = "agg"
    max_model_len: int = 1000

    @property
    def total_kv_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


class Transfers(Scheduler):
    """Decode-side KV transfers take 0 or 1.5 s, by prompt length."""

    def transfer_seconds(self, num_prompt_tokens: int) -> float:
        return 1.5 if num_prompt_tokens % 3 else 0.0


def seq_fields(seq: Sequence) -> tuple[Any, ...]:
    return (
        seq.request_id,
        list(seq.prompt),
        list(seq.output),
        list(seq.local_hashes),
        list(seq.block_hashes),
        list(seq.full_blocks),
        list(seq.unique_blocks),
        seq.num_computed_tokens,
        seq.prefill_end,
        seq.num_cached_tokens,
        seq.num_preemptions,
        seq.pending_transfer,
        seq.ready_at,
        seq.status,
        seq.finish_reason,
    )


def drive(
    impl: ModuleType,
    seed: int,
    shape: Shape,
    monkeypatch: pytest.MonkeyPatch,
    *,
    fused: bool = False,
    raw: bool = False,
    py_kv: bool = False,
    plans: list[Any] | None = None,
) -> list[Any]:
    """A random life of one scheduler on ``impl``'s kernels: everything observable, in order
    (each pass's batch into ``plans``). ``fused``: each pass is one ``mock_pass`` call; ``raw``:
    its KV manager records raw events (logged decoded); ``py_kv``: the KV manager is the Python
    twin (the native pass calls its methods instead of the native one's C calls)."""
    plans = [] if plans is None else plans
    for name in ("schedule_pass", "update_pass", "release_blocks", "mock_pass"):
        monkeypatch.setattr(scheduler, name, getattr(impl, name))
    rng = random.Random(seed)
    sched = Transfers(shape)
    if py_kv:
        sched.kv = _kv_fallback.KVManager(
            shape.num_gpu_blocks, enable_prefix_caching=shape.enable_prefix_caching
        )
    if raw:
        sched.kv.record_raw_events()
    groups = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    log: list[Any] = []
    seqs: list[Sequence] = []
    prompts: list[list[int]] = []
    now = 0.0
    for step in range(60):
        for _ in range(rng.choice([0, 1, 1, 2])):
            prompt = rng.choice(groups) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
            if len(prompt) % 3 == 0:  # one list under many sequences: none may change it
                prompt = groups[len(prompt) % 4]
            request = PreprocessedRequest(
                model="m",
                token_ids=prompt,
                stop=StopConditions(
                    max_tokens=rng.randrange(1, 40),
                    stop_token_ids=rng.sample(range(50), rng.randrange(0, 3)),
                ),
                eos_token_ids=[3],
                sampling=SamplingOptions(seed=rng.randrange(1 << 20)),
            )
            seq = sequence_from_request(shape, request, f"r{len(seqs)}", now)
            seq.reuse_prefix_cache = rng.random() < 0.9
            if rng.random() < 0.15:  # a decode-side request: its prompt's KV is transferred
                seq.handoff = DisaggregatedParams(prefill_worker_id=1, num_cached_tokens=3)
                seq.pending_transfer = True
            sched.enqueue(seq)
            seqs.append(seq)
            prompts.append(list(prompt))
            assert seq.prompt is prompt  # the request's list, kept
        if seqs and rng.random() < 0.08:
            log.append(("abort", sched.abort(rng.choice(seqs).request_id)))
        if fused:  # the mocker's one call
            preempted, prefill, decodes, context, tokens, finished, events = sched.mock_pass(
                now, 50, frozenset()
            )
            planned: list[tuple[str, int]] | None = None
        else:
            batch = sched.schedule(now)
            sampled = _pass_fallback.sample_tokens(batch.entries, 50, frozenset())
            result = sched.update(batch, sampled)
            preempted, tokens, finished, events = (
                batch.preempted,
                result.tokens,
                result.finished,
                result.events,
            )
            prefill, decodes = batch.num_prefill_tokens, batch.num_decodes
            context = batch.decode_context_tokens
            planned = [(s.request_id, n) for s, n in batch.entries]
        log.append(
            (
                step,
                [s.request_id for s in preempted],
                prefill,
                decodes,
                context,
                [(s.request_id, t) for s, t in tokens],
                [s.request_id for s in finished],
                msgspec.json.encode(kv_raw.decode(events) if raw else events),
                [s.request_id for s in sched._running],  # noqa: SLF001
                [s.request_id for s in sched._waiting],  # noqa: SLF001
            )
        )
        plans.append(planned)
        sched.check_invariants()
        now += rng.choice([0.0, 0.5, 1.0])
    log.append([seq_fields(s) for s in seqs])
    assert all(s.prompt == copy for s, copy in zip(seqs, prompts, strict=True))  # never changed
    return log


SHAPES = [
    Shape(),
    Shape(preemption_mode="fifo", num_gpu_blocks=24),
    Shape(enable_prefix_caching=False),
    Shape(enable_chunked_prefill=False, max_num_batched_tokens=40),
    Shape(num_gpu_blocks=200, max_num_seqs=3, block_size=8),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.preemption_mode}-{s.num_gpu_blocks}")
def test_scheduler_pass_matches_the_fallback(
    native: ModuleType, shape: Shape, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = {"preempted": 0, "finished": 0, "events": 0}
    for seed in range(12):
        plans: list[list[Any]] = [[], []]
        want = drive(_pass_fallback, seed, shape, monkeypatch, plans=plans[0])
        got = drive(native, seed, shape, monkeypatch, plans=plans[1])
        assert got == want
        assert drive(native, seed, shape, monkeypatch, py_kv=True) == want
        assert plans[0] == plans[1]
        for fused_impl in (_pass_fallback, native):  # the mocker's single call: the same life
            assert drive(fused_impl, seed, shape, monkeypatch, fused=True) == want
            raw = drive(fused_impl, seed, shape, monkeypatch, fused=True, raw=True)
            assert raw == want  # its events as one raw buffer a pass
        for row in want[:-1]:
            if row[0] != "abort":
                seen["preempted"] += len(row[1])
                seen["finished"] += len(row[6])
                seen["events"] += row[7] != b"[]"
    assert seen["finished"] > 50
    if shape.num_gpu_blocks < 100:
        assert seen["preempted"] > 0  # the pressure path was exercised
    assert (seen["events"] > 0) == shape.enable_prefix_caching


@pytest.mark.parametrize("impl", ["fallback", "native"])
def test_update_pass_refuses_a_missing_token_and_a_length_mismatch(
    native: ModuleType, impl: str
) -> None:
    module = native if impl == "native" else _pass_fallback
    sched = Scheduler(Shape())
    seq = sched.add_request(
        PreprocessedRequest(model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=2)),
        "r0",
        0.0,
    )
    batch = sched.schedule(0.0)
    args = (sched._running, sched._requests, sched.kv, BS)  # noqa: SLF001
    with pytest.raises(ValueError, match="no token sampled for 'r0'"):
        module.update_pass(batch.entries, [None], *args)
    with pytest.raises(ValueError, match="one item per batch entry"):
        module.update_pass(batch.entries, [], *args)
    assert seq.status is SequenceStatus.RUNNING


def test_update_pass_hashes_completed_blocks_as_the_router_does(native: ModuleType) -> None:
    from dynamo.router.hashing import local_block_hashes, sequence_hashes

    for module in (_pass_fallback, native):
        sched = Scheduler(Shape(enable_prefix_caching=False))
        seq = sched.add_request(
            PreprocessedRequest(
                model="m", token_ids=list(range(7)), stop=StopConditions(max_tokens=5)
            ),
            "r0",
            0.0,
        )
        batch = sched.schedule(0.0)
        module.update_pass(batch.entries, [41], sched._running, sched._requests, sched.kv, BS)  # noqa: SLF001
        assert seq.prompt == [*range(7)] and seq.output == [41]
        assert seq.local_hashes == local_block_hashes([*range(7), 41], BS)
        assert seq.block_hashes == sequence_hashes(seq.local_hashes)
        assert seq.finish_reason is None
        assert FinishReason.LENGTH.value == "length"


class OtherSequence(Sequence):
    """Not the class whose slot offsets the native pass learned: it takes the getattr path."""


def test_native_pass_reads_other_sequence_classes_through_attributes(native: ModuleType) -> None:
    results = []
    for cls in (Sequence, OtherSequence):
        sched = Scheduler(Shape(num_gpu_blocks=12))
        for i in range(4):
            request = PreprocessedRequest(
                model="m",
                token_ids=[1, 2, 3, 4, 5, i],
                stop=StopConditions(max_tokens=9, ignore_eos=True),
            )
            built = sequence_from_request(Shape(), request, f"r{i}", 0.0)
            kwargs = {f.name: getattr(built, f.name) for f in dataclasses.fields(built) if f.init}
            sched.enqueue(cls(**kwargs))
        log = []
        for _ in range(12):
            out = native.mock_pass(
                sched._running,  # noqa: SLF001
                sched._waiting,  # noqa: SLF001
                sched._requests,  # noqa: SLF001
                sched.kv,
                sched.config,
                0.0,
                sched.transfer_seconds,
                50,
                frozenset(),
            )
            log.append(
                (
                    [s.request_id for s in out[0]],
                    out[1:4],
                    [(s.request_id, t) for s, t in out[4]],
                    msgspec.json.encode(out[6]),
                )
            )
            sched.check_invariants()
        results.append(log)
    assert results[0] == results[1]
    assert any(row[0] for row in results[0])  # a preemption happened on both paths


class OtherList(list):  # type: ignore[type-arg]
    """Not an exact list: the native pass calls the KV manager's methods with it."""


@pytest.mark.parametrize("bad", [None, "x", 1 << 64, -(1 << 63) - 1])
def test_an_admission_in_c_refuses_what_the_methods_refuse(native: ModuleType, bad: Any) -> None:
    """The native KV manager's admission in C (``_kv_api.h``: the chain converted once) and
    its methods (a list subclass takes them): the same admissions, the same errors."""
    native_kv = pytest.importorskip("dynamo.engine_core._kv")
    outcomes = []
    for chain_type in (list, OtherList):
        results = []
        for good in (True, False):
            sched = Scheduler(Shape(num_gpu_blocks=40, max_num_batched_tokens=100))
            sched.kv = native_kv.KVManager(40)  # the native one (DYN_NATIVE=0 too)
            for i in range(3):
                request = PreprocessedRequest(
                    model="m", token_ids=list(range(i, i + 20)), stop=StopConditions(max_tokens=4)
                )
                seq = sequence_from_request(Shape(), request, f"r{i}", 0.0)
                seq.pending_transfer = True  # a received prompt: all its full blocks are used
                seq.handoff = DisaggregatedParams(prefill_worker_id=1, num_cached_tokens=0)
                hashes = list(seq.block_hashes)
                if not good and i == 2:
                    hashes[1] = bad
                seq.block_hashes = chain_type(hashes)
                sched.enqueue(seq)
            try:
                entries, *_ = native.schedule_pass(
                    sched._running,  # noqa: SLF001
                    sched._waiting,  # noqa: SLF001
                    sched.kv,
                    sched.config,
                    0.0,
                    sched.transfer_seconds,
                )
                results.append([(s.request_id, n, list(s.full_blocks)) for s, n in entries])
                sched.check_invariants()
            except (TypeError, OverflowError) as exc:
                results.append(type(exc).__name__)
        outcomes.append(results)
    assert outcomes[0] == outcomes[1]
    assert isinstance(outcomes[0][0], list) and outcomes[0][0][0][2]  # full blocks were used
    assert isinstance(outcomes[0][1], str)  # the bad hash was refused


@pytest.mark.parametrize("bad", [None, "unique", "hash", "local", "full"])
def test_promote_and_release_in_c_refuse_what_the_methods_refuse(
    native: ModuleType, bad: str | None
) -> None:
    """With the native KV manager, filled blocks are promoted and the finished released in C
    (``_kv_api.h``: the lists' items, no method call); list subclasses take the methods. Both:
    the same blocks, events and errors."""
    native_kv = pytest.importorskip("dynamo.engine_core._kv")
    outcomes = []
    for list_type in (list, OtherList):
        sched = Scheduler(Shape(num_gpu_blocks=40, max_num_batched_tokens=100))
        sched.kv = native_kv.KVManager(40)  # the native one (DYN_NATIVE=0 too)
        request = PreprocessedRequest(
            model="m", token_ids=list(range(13)), stop=StopConditions(max_tokens=1)
        )
        seq = sequence_from_request(Shape(), request, "r0", 0.0)
        sched.enqueue(seq)
        entries, *_ = native.schedule_pass(
            sched._running,  # noqa: SLF001
            sched._waiting,  # noqa: SLF001
            sched.kv,
            sched.config,
            0.0,
            sched.transfer_seconds,
        )
        unique, hashes, locals_ = (list(seq.unique_blocks), seq.block_hashes, seq.local_hashes)
        full = list(seq.full_blocks)
        if bad == "unique":  # a private block that is not allocated
            unique[1] = next(i for i in range(40) if i not in unique)
        elif bad == "hash":
            hashes[1] = "x"
        elif bad == "local":
            locals_[2] = 1 << 64
        elif bad == "full":  # a full block the manager does not hold
            full = [12345]
        seq.unique_blocks, seq.full_blocks = list_type(unique), list_type(full)
        seq.block_hashes, seq.local_hashes = list_type(hashes), list_type(locals_)
        args = (sched._running, sched._requests, sched.kv, BS)  # noqa: SLF001
        try:  # promotes the prompt's 3 filled blocks, then releases them (max_tokens=1)
            _, finished, events = native.update_pass(entries, [41], *args)
            outcomes.append(
                (
                    [s.request_id for s in finished],
                    msgspec.json.encode(events),
                    sorted(sched.kv.cached_blocks()),
                    sched.kv.num_active_blocks,
                    seq.full_blocks,
                    seq.unique_blocks,
                )
            )
            sched.kv.check_invariants()
        except (KeyError, TypeError, OverflowError) as exc:
            state = (sched.kv.num_active_blocks, list(seq.full_blocks), list(seq.unique_blocks))
            outcomes.append((type(exc).__name__, str(exc), state))
    assert outcomes[0] == outcomes[1]
    if bad is None:  # promoted (a Stored event of 3 blocks), released
        assert outcomes[0][0] == ["r0"] and len(outcomes[0][2]) == 3 and outcomes[0][3] == 0
    else:
        assert isinstance(outcomes[0][0], str)  # refused


@pytest.mark.parametrize("max_tokens", [1, 3, 1 << 30, 1 << 62, True])
def test_int_fields_of_any_size_read_as_the_fallback_reads_them(
    native: ModuleType, max_tokens: int
) -> None:
    """The native pass reads one-digit ints from their digit; wider ones, and an int subclass,
    through the API: the same finishes as the fallback."""
    outcomes = []
    for module in (_pass_fallback, native):
        sched = Scheduler(Shape())
        request = PreprocessedRequest(
            model="m", token_ids=[5, 6, 7], stop=StopConditions(max_tokens=4)
        )
        seq = sched.add_request(request, "r0", 0.0)
        seq.max_tokens = max_tokens
        seq.min_tokens = -(1 << 31)  # negative, two digits
        batch = sched.schedule(0.0)
        args = (sched._running, sched._requests, sched.kv, BS)  # noqa: SLF001
        _, finished, _ = module.update_pass(batch.entries, [41], *args)
        outcomes.append(([s.request_id for s in finished], seq.finish_reason))
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0][0] == ["r0"]) == (max_tokens == 1)


@pytest.mark.parametrize("frozen", [True, False])
def test_a_config_is_read_every_pass_unless_frozen(native: ModuleType, frozen: bool) -> None:
    """The native pass keeps the limits of a frozen dataclass config (it cannot change); any
    other config is read every pass, so a change to it shows in the next pass, as in the
    fallback."""
    outcomes = []
    for module in (_pass_fallback, native):
        sched = Scheduler(Shape())
        for i in range(4):
            request = PreprocessedRequest(
                model="m", token_ids=[1, 2, 3, i], stop=StopConditions(max_tokens=20)
            )
            sched.add_request(request, f"r{i}", 0.0)
        limits = Shape(max_num_seqs=1)
        config: Any = limits if frozen else Limits()
        if not frozen:
            config.max_num_seqs = 1
        running = []
        for seqs in (1, 3):
            if frozen:
                config = dataclasses.replace(limits, max_num_seqs=seqs)  # a new object
            else:
                config.max_num_seqs = seqs
            entries, *_ = module.schedule_pass(
                sched._running,  # noqa: SLF001
                sched._waiting,  # noqa: SLF001
                sched.kv,
                config,
                0.0,
                sched.transfer_seconds,
            )
            running.append([(s.request_id, n) for s, n in entries])
        outcomes.append(running)
    assert outcomes[0] == outcomes[1]
    assert [len(r) for r in outcomes[0]] == [1, 3]

"""The native pass keeps each sequence's full blocks' table slots (``Sequence.full_slots``,
``_kv_api.h``) so that a release finds the blocks without converting and looking up their
hashes: the kept slots are the manager's (``Scheduler.check_invariants`` checks them after every
pass of the random schedulers in test_pass_kernels.py), and only a hint: a release with wrong
slots checks each against its hash and releases exactly the blocks it would without them."""

from __future__ import annotations

import random
from array import array
from types import ModuleType

import msgspec
import pytest

from dynamo.engine_core.scheduler import Scheduler
from dynamo.engine_core.sequence import Sequence
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from tests.unit.engine_core.test_pass_kernels import Shape


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.engine_core._pass")


@pytest.fixture(scope="module")
def native_kv() -> ModuleType:
    return pytest.importorskip("dynamo.engine_core._kv")


def slots_of(seq: Sequence) -> list[int] | None:
    return None if seq.full_slots is None else memoryview(seq.full_slots).cast("i").tolist()


def run(native: ModuleType, native_kv: ModuleType, scramble: str | None) -> list[object]:
    """Four requests over two shared prefixes, passes until all finish: what is observable.
    ``scramble``: before each pass, every kept slot list is made wrong that way."""
    rng = random.Random(3)
    sched = Scheduler(Shape(num_gpu_blocks=30, max_num_batched_tokens=64))
    sched.kv = native_kv.KVManager(30)  # the native one (DYN_NATIVE=0 too)
    prefixes = [[rng.randrange(50) for _ in range(9)] for _ in range(2)]
    seqs = []
    for i in range(4):
        prompt = prefixes[i % 2] + [rng.randrange(50) for _ in range(3 + i)]
        request = PreprocessedRequest(
            model="m", token_ids=prompt, stop=StopConditions(max_tokens=6 + i)
        )
        seqs.append(sched.add_request(request, f"r{i}", 0.0))
    log: list[object] = []
    kept = 0
    for step in range(40):
        for seq in seqs:
            slots = slots_of(seq)
            kept += slots is not None and len(slots) > 0
            if scramble is not None and slots:
                wrong = slots[::-1] if scramble == "reversed" else [-1, 10**9, 0, 29] * len(slots)
                seq.full_slots = bytearray(array("i", wrong[: len(slots)]).tobytes())
        running, waiting, requests = sched._running, sched._waiting, sched._requests  # noqa: SLF001
        *head, tokens, finished, events = native.mock_pass(
            running,
            waiting,
            requests,
            sched.kv,
            sched.config,
            float(step),
            sched.transfer_seconds,
            50,
            frozenset(),
        )
        log.append(
            (
                [(s.request_id, t) for s, t in tokens],
                [s.request_id for s in finished],
                msgspec.json.encode(events),
                sorted(sched.kv.cached_blocks()),
                sched.kv.num_active_blocks,
            )
        )
        sched.kv.check_invariants()
        if not requests:
            break
    assert not sched._requests  # noqa: SLF001
    log.append(kept > 0)
    return log


@pytest.mark.parametrize("scramble", ["reversed", "garbage"])
def test_wrong_kept_slots_release_the_same_blocks(
    native: ModuleType, native_kv: ModuleType, scramble: str
) -> None:
    want = run(native, native_kv, None)
    assert want[-1] is True  # slots were kept, and released with
    assert run(native, native_kv, scramble) == want


def test_kept_slots_are_the_managers(native: ModuleType, native_kv: ModuleType) -> None:
    sched = Scheduler(Shape(num_gpu_blocks=30))
    sched.kv = native_kv.KVManager(30)
    request = PreprocessedRequest(
        model="m", token_ids=list(range(13)), stop=StopConditions(max_tokens=9)
    )
    seq = sched.add_request(request, "r0", 0.0)
    args = (sched._running, sched._waiting, sched._requests)  # noqa: SLF001
    seen = []
    for step in range(12):
        native.mock_pass(
            *args, sched.kv, sched.config, float(step), sched.transfer_seconds, 50, frozenset()
        )
        seen.append(slots_of(seq))
        if seq.full_blocks:
            assert slots_of(seq) == [sched.kv.slot_of(h) for h in seq.full_blocks]
    assert any(s for s in seen)  # kept while it ran (the prompt's blocks, then the output's)
    assert seq.full_slots is None and not seq.full_blocks  # released: none kept

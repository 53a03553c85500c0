"""The native KV manager's admission reads the keys of a chain's leading hash objects from the
last admitted chain that began with the same object (``_kv.c``'s memo: strong references,
identity only), as a prefix group's prompts share them in the offline replay: the same
admissions, blocks and events as the fallback, whether chains share their objects or not, and
whatever follows the shared run (other objects, equal values, a hash that is not an int)."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import msgspec
import pytest

from dynamo.engine_core import _kv_fallback, _pass_fallback
from dynamo.engine_core.scheduler import Scheduler
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from tests.unit.engine_core.test_pass_kernels import Shape


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.engine_core._pass")


def admit_all(module: ModuleType, kv: Any, shared: bool, bad: bool) -> list[Any]:
    """Twelve requests over three prefixes, admitted and run a few passes: what is observable.
    ``shared``: each request's leading hashes are its prefix group's first request's objects."""
    rng = random.Random(5)
    sched = Scheduler(Shape(num_gpu_blocks=60, max_num_batched_tokens=400, max_num_seqs=4))
    sched.kv = kv
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    first: dict[int, list[int]] = {}
    for i in range(12):
        g = i % 3
        prompt = prefixes[g] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        request = PreprocessedRequest(
            model="m", token_ids=prompt, stop=StopConditions(max_tokens=3)
        )
        seq = sched.add_request(request, f"r{i}", 0.0)
        if shared and g in first:  # the group's objects for its whole prefix
            seq.block_hashes[:3] = first[g][:3]
        first.setdefault(g, seq.block_hashes)
        if bad and i == 7:
            seq.block_hashes[4 % len(seq.block_hashes)] = "x" if len(seq.block_hashes) > 4 else 1
    log: list[Any] = []
    for step in range(12):
        try:
            entries, preempted, *figures = module.schedule_pass(
                sched._running,
                sched._waiting,
                sched.kv,
                sched.config,
                float(step),  # noqa: SLF001
                sched.transfer_seconds,
            )
        except TypeError as exc:
            log.append(str(exc))
            break
        sampled = _pass_fallback.sample_tokens(entries, 50, frozenset())
        tokens, finished, events = module.update_pass(
            entries,
            sampled,
            sched._running,
            sched._requests,
            sched.kv,
            4,  # noqa: SLF001
        )
        log.append(
            (
                [(s.request_id, n, list(s.full_blocks)) for s, n in entries],
                figures,
                [s.request_id for s in finished],
                msgspec.json.encode(events),
            )
        )
    return log


@pytest.mark.parametrize("bad", [False, True])
def test_shared_leading_hashes_admit_as_without_them(native: ModuleType, bad: bool) -> None:
    native_kv = pytest.importorskip("dynamo.engine_core._kv")
    want = admit_all(_pass_fallback, _kv_fallback.KVManager(60), False, bad)
    assert any(row[0] for row in want if isinstance(row, tuple))
    for shared in (False, True, True):  # twice: the second run meets the first's memo
        assert admit_all(native, native_kv.KVManager(60), shared, bad) == want

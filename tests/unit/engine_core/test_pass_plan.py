"""The native pass plans its first 16 batch entries in its caller's stack arrays and moves to a
heap block past them (``_pass.c`` ``plan_grow``): a pass of more sequences than that, with
preemptions removing planned ones, gives the fallback's batch, figures and state."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from dynamo.engine_core import _pass_fallback
from dynamo.engine_core.scheduler import Scheduler
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from tests.unit.engine_core.test_pass_kernels import Shape


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.engine_core._pass")


def passes(module: ModuleType, blocks: int) -> list[Any]:
    """40 requests admitted in one pass, then decodes until they finish (``blocks`` small:
    growing them preempts planned ones)."""
    sched = Scheduler(Shape(num_gpu_blocks=blocks, max_num_seqs=64, max_num_batched_tokens=400))
    for i in range(40):
        request = PreprocessedRequest(
            model="m", token_ids=[i % 7, 1, 2], stop=StopConditions(max_tokens=6)
        )
        sched.add_request(request, f"r{i}", 0.0)
    log: list[Any] = []
    for step in range(12):
        entries, preempted, *figures = module.schedule_pass(
            sched._running,  # noqa: SLF001
            sched._waiting,  # noqa: SLF001
            sched.kv,
            sched.config,
            float(step),
            sched.transfer_seconds,
        )
        sampled = _pass_fallback.sample_tokens(entries, 50, frozenset())
        _, finished, _ = module.update_pass(
            entries,
            sampled,
            sched._running,
            sched._requests,
            sched.kv,
            4,  # noqa: SLF001
        )
        log.append(
            (
                [(s.request_id, n) for s, n in entries],
                [s.request_id for s in preempted],
                figures,
                [s.request_id for s in finished],
            )
        )
    return log


@pytest.mark.parametrize("blocks", [400, 60])
def test_a_pass_of_more_than_16_sequences_plans_as_the_fallback(
    native: ModuleType, blocks: int
) -> None:
    want = passes(_pass_fallback, blocks)
    assert max(len(row[0]) for row in want) > 16
    assert (blocks == 60) == any(row[1] for row in want)  # the small pool preempts
    assert passes(native, blocks) == want

"""A packed prompt (an ``array('I')`` of the ids, the offline replay's) runs as its list does:
the sequence keeps it, its blocks hash the same (a decode completing a block that starts in the
prompt reads its ids too), the passes give the same tokens, finishes and KV events. Natively
and with ``DYN_NATIVE=0`` (the twins)."""

from __future__ import annotations

import random
from array import array
from typing import Any

from dynamo.engine_core.sequence import new_sequence
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.simulator import MockerScheduler


def _passes(prompts: list[Any], block_size: int) -> list[Any]:
    sched = MockerScheduler(MockerConfig(num_gpu_blocks=64, block_size=block_size))
    for i, prompt in enumerate(prompts):
        seq = new_sequence(sched.config, prompt, f"r{i}", 0.0, max_tokens=9, ignore_eos=True)
        assert seq.prompt is prompt  # kept, packed or not
        sched.enqueue(seq)
    out = []
    now = 0.0
    while sched.has_work:
        step = sched.step(now)
        now += max(step.duration, 1e-3)
        out.append(
            (
                [(s.request_id, t) for s, t in step.tokens],
                [(s.request_id, s.block_hashes, s.local_hashes) for s in step.finished],
                step.events,
            )
        )
    return out


def test_a_packed_prompt_runs_as_its_list() -> None:
    rng = random.Random(4)
    for block_size in (4, 16):
        lists = [[rng.randrange(50_000) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
        lists.append(lists[0][:40] + [7, 8, 9])  # a shared prefix: cached blocks
        packed = [array("I", ids) for ids in lists]
        assert _passes(packed, block_size) == _passes(lists, block_size)


def test_tokens_of_a_packed_prompt_are_a_list() -> None:
    config = MockerConfig(num_gpu_blocks=64, block_size=4)
    ids = [5, 6, 7, 8, 9, 10]
    seq = new_sequence(config, array("I", ids), "r", 0.0, max_tokens=4, ignore_eos=True)
    seq.output.extend([1, 2])
    whole = [*ids, 1, 2]
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            got = seq.tokens(start, end)
            assert type(got) is list and got == whole[start:end]

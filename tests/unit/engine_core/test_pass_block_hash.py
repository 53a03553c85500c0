"""The native pass hashes a block a decode completes in C (XXH3-64, router/_hash.c's vendored
implementation) when the sequence's hash seed is an exact int in [0, 2**64), and through the
``xxhash`` package otherwise: the same local and chained hashes as the fallback and the
router's ``block_hash`` / ``next_sequence_hash``, for every seed it accepts."""

from __future__ import annotations

from types import ModuleType

import pytest

from dynamo.engine_core import _pass_fallback
from dynamo.engine_core.scheduler import Scheduler
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.router.hashing import block_hash, block_seed, next_sequence_hash
from tests.unit.engine_core.test_pass_kernels import BS, Shape


class Seed(int):
    """Not an exact int: the native pass hands it to xxhash's function."""


SEEDS = [block_seed(None), block_seed("adapter"), 0, (1 << 64) - 1, Seed(block_seed("x"))]


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.engine_core._pass")


def hashes_after(module: ModuleType, seed: int, prompt_len: int) -> tuple[list[int], list[int]]:
    """One sampled token after a prompt of ``prompt_len`` ids (one short of a block boundary):
    the sequence's local and chained hashes once the token completes its block."""
    sched = Scheduler(Shape(enable_prefix_caching=False))
    request = PreprocessedRequest(
        model="m",
        token_ids=[(7 * i) % 50 for i in range(prompt_len)],
        stop=StopConditions(max_tokens=3),
    )
    seq = sched.add_request(request, "r0", 0.0)
    seq.hash_seed = seed
    batch = sched.schedule(0.0)
    args = (sched._running, sched._requests, sched.kv, BS)  # noqa: SLF001
    module.update_pass(batch.entries, [41], *args)
    return list(seq.local_hashes), list(seq.block_hashes)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"{type(s).__name__}-{int(s)}")
@pytest.mark.parametrize("prompt_len", [BS - 1, 3 * BS - 1])
def test_a_completed_block_hashes_as_the_router_does(
    native: ModuleType, seed: int, prompt_len: int
) -> None:
    local, chain = hashes_after(native, seed, prompt_len)
    assert (local, chain) == hashes_after(_pass_fallback, seed, prompt_len)
    tokens = [(7 * i) % 50 for i in range(prompt_len)] + [41]
    assert local[-1] == block_hash(tokens[-BS:], seed)
    want = local[-1] if len(chain) == 1 else next_sequence_hash(chain[-2], local[-1])
    assert chain[-1] == want

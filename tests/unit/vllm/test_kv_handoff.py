"""The vLLM connector's worker side without vLLM: two ``HandoffWorker``s over paged KV tensors
shaped as vLLM's CPU caches, moving a held prompt's blocks over real loopback sockets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from dynamo.vllm.kv_handoff import HandoffWorker, Load  # noqa: E402
from dynamo.vllm.paged_kv import LayoutMismatch, PagedKV  # noqa: E402

pytestmark = pytest.mark.integration  # real loopback sockets, one process

BLOCKS, HEADS, BS, HD = 16, 2, 4, 8


def caches(seed: int, layers: int = 3, dtype: torch.dtype = torch.float32) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.attn": torch.randn(BLOCKS, HEADS, BS * 2, HD, generator=gen).to(dtype)
        for i in range(layers)
    }


def wait_finished(worker: HandoffWorker, timeout: float = 30.0) -> tuple[set, set, set]:
    """The first non-empty (sent, received, failed) report."""
    deadline = time.monotonic() + timeout
    while True:
        sent, received, failed = worker.take_finished()
        if sent or received or failed:
            return sent, received, failed
        assert time.monotonic() < deadline, "no transfer finished"
        time.sleep(0.01)


@pytest.fixture
def pair() -> Iterator[tuple[HandoffWorker, HandoffWorker]]:
    prefill = HandoffWorker(PagedKV(caches(1), BLOCKS, BS))  # type: ignore[arg-type]
    decode = HandoffWorker(PagedKV(caches(2), BLOCKS, BS))  # type: ignore[arg-type]
    prefill.start(), decode.start()
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_held_blocks_land_in_the_decode_sides_blocks(pair: tuple[HandoffWorker, ...]) -> None:
    prefill, decode = pair
    prefill.hold("req-1", [5, 2, 9, 11])
    decode.load("d-1", Load("127.0.0.1", prefill.port, "req-1", [2, 9], [0, 7]))
    assert wait_finished(decode) == (set(), {"d-1"}, set())
    for name, src in prefill.kv.caches.items():
        dst = decode.kv.caches[name]
        assert torch.equal(dst[0], src[2]) and torch.equal(dst[7], src[9])
    # the pull ended the handoff: vLLM may free the prefill side's blocks
    assert wait_finished(prefill) == ({"req-1"}, set(), set())
    assert decode.stats.bytes_received == 2 * decode.kv.bytes_per_block
    assert decode.stats.pulls == 1
    # a second pull of the same handoff finds nothing
    decode.load("d-2", Load("127.0.0.1", prefill.port, "req-1", [2], [1]))
    assert wait_finished(decode) == (set(), {"d-2"}, {"d-2"})


def test_a_pull_before_the_hold_waits_for_it(pair: tuple[HandoffWorker, ...]) -> None:
    prefill, decode = pair
    decode.load("d-1", Load("127.0.0.1", prefill.port, "late", [3], [4]))
    time.sleep(0.2)
    prefill.hold("late", [3])
    assert wait_finished(decode) == (set(), {"d-1"}, set())


def test_an_empty_pull_only_ends_the_handoff(pair: tuple[HandoffWorker, ...]) -> None:
    prefill, decode = pair
    prefill.hold("cached", [1, 2])
    decode.load("d-1", Load("127.0.0.1", prefill.port, "cached", [], []))
    assert wait_finished(prefill) == ({"cached"}, set(), set())
    assert decode.take_finished() == (set(), set(), set())  # no request waited on it


def test_blocks_outside_the_handoff_are_refused(pair: tuple[HandoffWorker, ...]) -> None:
    prefill, decode = pair
    prefill.hold("req", [1, 2])
    decode.load("d-1", Load("127.0.0.1", prefill.port, "req", [1, 3], [0, 1]))
    assert wait_finished(decode) == (set(), {"d-1"}, {"d-1"})
    decode.load("d-2", Load("127.0.0.1", prefill.port, "req", [1, 2], [0, 1]))
    assert wait_finished(decode) == (set(), {"d-2"}, set())  # the handoff survived the bad pull


def test_an_unreachable_prefill_worker_fails_the_load(pair: tuple[HandoffWorker, ...]) -> None:
    _, decode = pair
    decode.load("d-1", Load("127.0.0.1", 1, "x", [1], [1]))
    assert wait_finished(decode) == (set(), {"d-1"}, {"d-1"})


def test_a_handoff_nobody_pulls_is_dropped() -> None:
    worker = HandoffWorker(PagedKV(caches(1), BLOCKS, BS), hold_timeout_s=0.05)  # type: ignore[arg-type]
    worker.start()
    try:
        worker.hold("gone", [1])
        time.sleep(0.1)
        assert worker.take_finished() == ({"gone"}, set(), set())
    finally:
        worker.close()


def test_another_layout_is_refused_before_writing() -> None:
    kv = PagedKV(caches(1), BLOCKS, BS)  # type: ignore[arg-type]
    half = PagedKV(caches(1, dtype=torch.bfloat16), BLOCKS, BS)  # type: ignore[arg-type]
    before = {n: t.clone() for n, t in kv.caches.items()}
    with pytest.raises(LayoutMismatch):
        kv.load([0], half.export([0]), half.layout)
    with pytest.raises(ValueError, match="bytes for"):
        kv.load([0, 1], kv.export([0]), kv.layout)
    with pytest.raises(ValueError, match="out of"):
        kv.export([BLOCKS])
    assert all(torch.equal(kv.caches[n], before[n]) for n in before)


def test_block_axis_one_as_on_cuda() -> None:
    gen = torch.Generator().manual_seed(3)
    kv = PagedKV({"l0": torch.randn(2, BLOCKS, BS, HEADS, HD, generator=gen)}, BLOCKS, BS)  # type: ignore[dict-item]
    other = PagedKV({"l0": torch.zeros(2, BLOCKS, BS, HEADS, HD)}, BLOCKS, BS)  # type: ignore[dict-item]
    other.load([3, 4], kv.export([6, 1]), kv.layout)
    assert torch.equal(other.caches["l0"][:, 3], kv.caches["l0"][:, 6])
    assert torch.equal(other.caches["l0"][:, 4], kv.caches["l0"][:, 1])

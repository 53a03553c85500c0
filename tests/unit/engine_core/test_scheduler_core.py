"""The shared scheduler as a real engine drives it (schedule, run, update): blocks are cached
and announced only once computed, every block has its own slot, and a private copy of a block
that turns out to be cached collapses onto the cached one."""

from __future__ import annotations

from dataclasses import dataclass

from dynamo.engine_core.scheduler import ScheduledBatch, Scheduler
from dynamo.protocol.kv_events import BlocksStored
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from tests.unit.engine_core.block_set import BlockSetSubscriber

BS = 4


@dataclass(frozen=True)
class Limits:
    block_size: int = BS
    num_gpu_blocks: int = 32
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 8
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "lifo"
    disaggregation_mode: str = "agg"
    max_model_len: int = 128

    @property
    def total_kv_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def req(tokens: list[int], max_tokens: int = 2) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m", token_ids=tokens, stop=StopConditions(max_tokens=max_tokens, ignore_eos=True)
    )


def run_pass(s: Scheduler, sub: BlockSetSubscriber) -> ScheduledBatch:
    batch = s.schedule(0.0)
    sampled = [99 if batch.samples(seq, n) else None for seq, n in batch.entries]
    for seq, _ in batch.entries:  # every running sequence's blocks are distinct slots
        table = s.kv.block_table(seq.full_blocks, seq.unique_blocks)
        assert len(set(table)) == len(table) and all(0 <= b < 32 for b in table)
    sub.apply(s.update(batch, sampled).events)
    s.check_invariants()
    assert sub.blocks == s.kv.cached_blocks()
    return batch


def test_blocks_are_announced_as_chunks_complete_and_never_hit_before() -> None:
    s, sub = Scheduler(Limits(max_num_batched_tokens=12)), BlockSetSubscriber()
    prompt = list(range(1, 21))  # 5 blocks: chunks of 12 and 8
    a = s.add_request(req(prompt), "a", 0.0)
    run_pass(s, sub)
    assert a.num_computed_tokens == 12 and len(a.full_blocks) == 3 and len(sub.blocks) == 3
    b = s.add_request(req(prompt), "b", 0.0)
    run_pass(s, sub)  # b joins a's last chunk: it reuses only the 3 blocks computed before
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 16
    while s.has_work:
        run_pass(s, sub)
    assert len(sub.blocks) == 5
    assert s.kv.num_active_blocks == 0


def test_a_private_copy_collapses_onto_the_cached_block_and_frees_its_slot() -> None:
    s, sub = Scheduler(Limits(max_num_batched_tokens=64)), BlockSetSubscriber()
    prompt = list(range(1, 10))  # 2 full blocks + 1 token
    a = s.add_request(req(prompt, 3), "a", 0.0)
    b = s.add_request(req(prompt, 3), "b", 0.0)
    batch = s.schedule(0.0)
    assert [n for _, n in batch.entries] == [9, 9]  # both computed in the same pass
    assert s.kv.num_active_blocks == 6
    sampled = [7, 7]
    events = s.update(batch, list(sampled)).events
    sub.apply(events)
    # a stored its two blocks (one event); b's identical private blocks collapsed onto them.
    assert [type(e.data) for e in events] == [BlocksStored]
    assert a.full_blocks == b.full_blocks and s.kv.num_active_blocks == 4
    table_a = s.kv.block_table(a.full_blocks, a.unique_blocks)
    table_b = s.kv.block_table(b.full_blocks, b.unique_blocks)
    assert table_a[:2] == table_b[:2] and table_a[2] != table_b[2]
    s.check_invariants()
    while s.has_work:
        run_pass(s, sub)
    assert s.kv.num_active_blocks == 0


def test_abort_frees_every_slot() -> None:
    s, sub = Scheduler(Limits()), BlockSetSubscriber()
    for i in range(4):
        s.add_request(req(list(range(10 * i, 10 * i + 12)), 5), f"r{i}", 0.0)
    run_pass(s, sub)
    run_pass(s, sub)
    for i in range(4):
        s.abort(f"r{i}")
    s.check_invariants()
    assert not s.has_work and s.kv.num_active_blocks == 0
    assert s.kv.num_available_blocks == 32

"""The cache-consistency summaries: the same block set gives the same (count, digest) on the
router's index and on the worker's local index, whatever the order; a difference is drift."""

from __future__ import annotations

from dynamo.protocol.kv_events import (
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    KVRecoveryRequest,
    StoredBlock,
)
from dynamo.router.consistency import drift_blocks
from dynamo.router.indexer import KVIndexer
from dynamo.router.local_index import LocalKVIndex


def stored(parent: int | None, *ids: int) -> BlocksStored:
    return BlocksStored(parent_hash=parent, blocks=[StoredBlock(i, i * 7) for i in ids])


def test_router_and_worker_digests_agree_and_diverge() -> None:
    local = LocalKVIndex(worker_id=5)
    router = KVIndexer()
    for data in (
        stored(None, 1, 2, 3),
        stored(3, 4),
        stored(None, 9),
        BlocksRemoved(block_hashes=[4]),
    ):
        event = local.record(data)
        router.apply(5, event)
    answer = local.answer(KVRecoveryRequest(digest_only=True))
    assert answer.events == [] and answer.last_event_id == 3
    assert (answer.num_blocks, answer.digest) == router.digest(5) and answer.num_blocks == 4
    # Learnt in another order (a dump), the same blocks give the same summary.
    other = KVIndexer()
    other.apply_recovery(local.answer(KVRecoveryRequest()))
    assert other.digest(5) == router.digest(5)
    # A block the router missed is drift.
    router.apply(5, KVCacheEvent(event_id=4, data=BlocksRemoved(block_hashes=[9])))
    assert drift_blocks(router.digest(5), (answer.num_blocks, answer.digest)) == 1
    assert drift_blocks((3, 10), (3, 11)) == 1  # same count, other blocks
    assert drift_blocks((3, 10), (3, 10)) == 0
    assert router.digest(77) == (0, 0)  # an unknown worker

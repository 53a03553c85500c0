"""KV events on the event plane use the FACTS §2.1 serde shape and round-trip exactly."""

from __future__ import annotations

import msgspec

from dynamo.protocol.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    KVEventBatch,
    StoredBlock,
)
from dynamo.protocol.kv_wire import decode_batch, encode_batch

BATCH = KVEventBatch(
    worker_id=7,
    events=[
        KVCacheEvent(
            event_id=0,
            data=BlocksStored(parent_hash=None, blocks=[StoredBlock(1001, 2**64 - 1)]),
        ),
        KVCacheEvent(event_id=1, data=BlocksRemoved(block_hashes=[1001]), dp_rank=1),
        KVCacheEvent(event_id=2, data=AllBlocksCleared()),
    ],
)


def test_round_trip() -> None:
    assert decode_batch(encode_batch(BATCH)) == BATCH


def test_reference_shape() -> None:
    events = msgspec.msgpack.decode(encode_batch(BATCH))
    assert events[0] == {
        "worker_id": 7,
        "storage_tier": "device",
        "residency_domain": "worker",
        "event": {
            "event_id": 0,
            "dp_rank": 0,
            "data": {
                "stored": {
                    "parent_hash": None,
                    "start_position": None,
                    "blocks": [
                        {"block_hash": 1001, "tokens_hash": 2**64 - 1, "mm_extra_info": None}
                    ],
                }
            },
        },
    }
    assert events[1]["event"]["data"] == {"removed": {"block_hashes": [1001]}}
    assert events[2]["event"]["data"] == "cleared"


def test_minimal_reference_event_is_accepted() -> None:
    """The minimal stored event of FACTS §2.1 (no dp_rank, no start_position) decodes."""
    minimal = [
        {
            "worker_id": 3,
            "event": {
                "event_id": 1,
                "data": {
                    "stored": {
                        "parent_hash": None,
                        "blocks": [{"block_hash": 1001, "tokens_hash": 5}],
                    }
                },
            },
        }
    ]
    batch = decode_batch(msgspec.msgpack.encode(minimal))
    assert batch is not None and batch.worker_id == 3
    assert batch.events[0].data == BlocksStored(parent_hash=None, blocks=[StoredBlock(1001, 5)])


def test_other_tiers_are_not_indexed() -> None:
    host = [
        {"worker_id": 3, "storage_tier": "host_pinned", "event": {"event_id": 1, "data": "cleared"}}
    ]
    assert decode_batch(msgspec.msgpack.encode(host)) is None

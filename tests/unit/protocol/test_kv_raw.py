"""protocol/kv_raw.py: the raw form of a pass's KV events round-trips exactly (negative and
full 64-bit values, parentless runs, empty removals) and refuses what it cannot hold."""

from __future__ import annotations

import struct

import pytest

from dynamo.protocol import kv_raw
from dynamo.protocol.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    StoredBlock,
)


def event(eid: int, data: BlocksStored | BlocksRemoved, rank: int = 2) -> KVCacheEvent:
    return KVCacheEvent(event_id=eid, data=data, dp_rank=rank)


def test_events_round_trip() -> None:
    top = (1 << 64) - 1
    events = [
        event(7, BlocksStored(parent_hash=None, blocks=[StoredBlock(1, -2), StoredBlock(top, 3)])),
        event(8, BlocksRemoved(block_hashes=[-(1 << 63), 5, top])),
        event(9, BlocksStored(parent_hash=-9, blocks=[StoredBlock(4, 4)])),
        event(10, BlocksRemoved(block_hashes=[])),
        event(11, BlocksStored(parent_hash=top, blocks=[StoredBlock(0, 0)])),
    ]
    raw = kv_raw.encode(events)
    assert kv_raw.header(raw) == (2, 7, 5)
    assert kv_raw.decode(raw) == events
    assert kv_raw.encode([]) == b"" and kv_raw.decode(b"") == []
    plain = kv_raw.encode(events[-1:])  # no negative value: no flag words
    assert len(plain) == 8 * (3 + 1 + 3)


def test_what_has_no_raw_form_is_refused() -> None:
    stored = BlocksStored(parent_hash=None, blocks=[StoredBlock(1, 1)])
    with pytest.raises(ValueError, match="cleared"):
        kv_raw.encode([KVCacheEvent(event_id=0, data=AllBlocksCleared())])
    with pytest.raises(ValueError, match="consecutive"):
        kv_raw.encode([event(0, stored), event(2, stored)])
    with pytest.raises(ValueError, match="consecutive"):
        kv_raw.encode([event(0, stored), event(1, stored, rank=3)])
    with pytest.raises(OverflowError):
        kv_raw.encode([event(0, BlocksRemoved(block_hashes=[1 << 64]))])
    good = kv_raw.encode([event(0, stored)])
    for bad in (good[:-1], good[:-8], good + bytes(8), good[:16], struct.pack("=4Q", 0, 0, 1, 3)):
        with pytest.raises(ValueError):
            kv_raw.decode(bad)

"""Test helper: a worker's cached block set rebuilt from its KV events, as a router would."""

from __future__ import annotations

from dynamo.protocol.kv_events import BlocksRemoved, BlocksStored, KVCacheEvent


class BlockSetSubscriber:
    """Rebuilds a worker's cached block set from its KV events, as a router's indexer would."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.next_id = 0

    def apply(self, events: list[KVCacheEvent]) -> None:
        for ev in events:
            assert ev.event_id == self.next_id, "gap or reorder in event ids"
            self.next_id += 1
            data = ev.data
            if isinstance(data, BlocksStored):
                assert data.parent_hash is None or data.parent_hash in self.blocks, "unknown parent"
                for b in data.blocks:
                    assert b.block_hash not in self.blocks, "stored twice"
                    self.blocks.add(b.block_hash)
            elif isinstance(data, BlocksRemoved):
                for h in data.block_hashes:
                    self.blocks.remove(h)
            else:
                self.blocks.clear()

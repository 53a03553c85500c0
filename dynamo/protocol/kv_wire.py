"""The KV-event wire schema of FACTS §2.1, as published on the event plane.

Inside a process, events are the tagged structs of ``kv_events.py``. On the event plane they take
the reference's serde shape, so other consumers can read them::

    RouterEvent = {worker_id, storage_tier, residency_domain,
                   event: {event_id, data, dp_rank}}
    data = {"stored": {parent_hash, start_position, blocks: [{block_hash, tokens_hash,
                                                               mm_extra_info}]}}
         | {"removed": {block_hashes}}
         | "cleared"

A message on topic ``kv-events`` is a msgpack array of RouterEvents of one worker.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from dynamo.protocol.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    KVCacheEventData,
    KVEventBatch,
    StoredBlock,
)


class WireStoredBlock(msgspec.Struct, kw_only=True, gc=False):
    block_hash: int
    tokens_hash: int
    mm_extra_info: dict[str, Any] | None = None


class WireStored(msgspec.Struct, kw_only=True):
    parent_hash: int | None
    blocks: list[WireStoredBlock]
    start_position: int | None = None


class WireRemoved(msgspec.Struct, kw_only=True):
    block_hashes: list[int]


class WireEventData(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Externally tagged: exactly one of ``stored`` / ``removed`` is set."""

    stored: WireStored | None = None
    removed: WireRemoved | None = None


class WireKVCacheEvent(msgspec.Struct, kw_only=True):
    event_id: int
    data: WireEventData | Literal["cleared"]
    dp_rank: int = 0


class WireRouterEvent(msgspec.Struct, kw_only=True):
    worker_id: int
    event: WireKVCacheEvent
    storage_tier: str = "device"
    residency_domain: str = "worker"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[WireRouterEvent])


def _data_to_wire(data: KVCacheEventData) -> WireEventData | Literal["cleared"]:
    if isinstance(data, BlocksStored):
        blocks = [
            WireStoredBlock(block_hash=b.block_hash, tokens_hash=b.tokens_hash) for b in data.blocks
        ]
        return WireEventData(stored=WireStored(parent_hash=data.parent_hash, blocks=blocks))
    if isinstance(data, BlocksRemoved):
        return WireEventData(removed=WireRemoved(block_hashes=data.block_hashes))
    return "cleared"


def _data_from_wire(data: WireEventData | Literal["cleared"]) -> KVCacheEventData:
    if data == "cleared":
        return AllBlocksCleared()
    assert isinstance(data, WireEventData)
    if data.stored is not None:
        blocks = [StoredBlock(b.block_hash, b.tokens_hash) for b in data.stored.blocks]
        return BlocksStored(parent_hash=data.stored.parent_hash, blocks=blocks)
    if data.removed is not None:
        return BlocksRemoved(block_hashes=data.removed.block_hashes)
    raise ValueError("a KV event's data must be stored, removed or cleared")


def encode_batch(batch: KVEventBatch) -> bytes:
    """One worker's batch as a msgpack array of RouterEvents."""
    return _encoder.encode(
        [
            WireRouterEvent(
                worker_id=batch.worker_id,
                event=WireKVCacheEvent(
                    event_id=ev.event_id, data=_data_to_wire(ev.data), dp_rank=ev.dp_rank
                ),
            )
            for ev in batch.events
        ]
    )


def decode_batch(payload: bytes) -> KVEventBatch | None:
    """The batch of a ``kv-events`` message; None if empty. Device-tier events only (other tiers
    are not indexed). Raises ``msgspec.DecodeError`` / ``ValueError`` on a malformed message."""
    events = _decoder.decode(payload)
    device = [e for e in events if e.storage_tier == "device"]
    if not device:
        return None
    worker_id = device[0].worker_id
    if any(e.worker_id != worker_id for e in device):
        raise ValueError("a kv-events message must hold the events of one worker")
    return KVEventBatch(
        worker_id=worker_id,
        events=[
            KVCacheEvent(
                event_id=e.event.event_id,
                data=_data_from_wire(e.event.data),
                dp_rank=e.event.dp_rank,
            )
            for e in device
        ],
    )

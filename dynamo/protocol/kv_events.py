"""KV cache events (FACTS §2.1): what workers publish and routers index.

``block_hash`` is the engine's own (opaque) id for a block, used for parent lookup and removal;
``tokens_hash`` is the *local* block hash of router/hashing.py, used for prefix matching.
"""

from __future__ import annotations

import msgspec

KV_EVENTS_TOPIC = "kv-events"
"""Event-plane topic of KV events (the FACTS §2.1 wire schema: ``kv_wire.py``)."""
RECOVERY_ENDPOINT = "kv_recovery"
"""Request-plane endpoint (beside a worker's generate endpoint) answering ``KVRecoveryRequest``."""


class StoredBlock(msgspec.Struct, array_like=True, gc=False):
    block_hash: int
    tokens_hash: int


class BlocksStored(msgspec.Struct, tag="stored", kw_only=True):
    parent_hash: int | None
    blocks: list[StoredBlock]


class BlocksRemoved(msgspec.Struct, tag="removed", kw_only=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag="cleared", kw_only=True):
    pass


KVCacheEventData = BlocksStored | BlocksRemoved | AllBlocksCleared


class KVCacheEvent(msgspec.Struct, kw_only=True):
    """One event of one (worker, dp_rank). ``event_id`` increases by one per event per rank."""

    event_id: int
    data: KVCacheEventData
    dp_rank: int = 0


class RouterEvent(msgspec.Struct, kw_only=True):
    worker_id: int
    event: KVCacheEvent
    storage_tier: str = "device"


class KVEventBatch(msgspec.Struct, kw_only=True):
    """Events of one worker published together on the event plane (topic ``kv-events``)."""

    worker_id: int
    events: list[KVCacheEvent]


class KVRecoveryRequest(msgspec.Struct, kw_only=True):
    """A router asks a worker's local index for events from ``start_event_id`` (None: full dump),
    or (``digest_only``) just the count and digest of its blocks (the consistency check)."""

    dp_rank: int = 0
    start_event_id: int | None = None
    digest_only: bool = False


class KVRecoveryResponse(msgspec.Struct, kw_only=True):
    """Either the buffered tail of events, or (``is_dump``) the whole state as stored events."""

    worker_id: int
    dp_rank: int
    events: list[KVCacheEvent]
    is_dump: bool
    last_event_id: int | None
    # Set on a digest_only answer: the rank's block count and ``RadixTree.digest``.
    num_blocks: int | None = None
    digest: int | None = None

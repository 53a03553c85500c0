"""vLLM's KV events (FACTS §2.2: msgpack batches on its ZMQ publisher) as ours (FACTS §2.1).

vLLM names a block by its own hash; the router matches on the *local* block hash of
``router/hashing.py`` computed from the block's tokens, and finds parents and removals by the
worker's block id. The bridge recomputes both from the token ids vLLM sends: ``tokens_hash`` is
our local hash, ``block_hash`` our chained sequence hash (the ids the mocker and the PyTorch
engine publish), and it remembers vLLM's hash -> ours for the parents and removals that follow.
Event ids are the bridge's own, one per event, from 0.

Pure conversion (no ZMQ, no vLLM import): :class:`KVEventBridge.convert` takes one decoded
batch; :func:`decode_batch` decodes the wire bytes.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from dynamo.protocol.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    StoredBlock,
)
from dynamo.router.hashing import local_block_hashes, next_sequence_hash, to_unsigned64

log = logging.getLogger(__name__)

_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]], int | None]:
    """``[ts, events, dp_rank?]`` -> (ts, events as tagged lists, dp_rank)."""
    raw = _decoder.decode(payload)
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("not a vLLM KV event batch")
    dp_rank = raw[2] if len(raw) > 2 else None
    return float(raw[0]), raw[1], dp_rank


class KVEventBridge:
    """One vLLM engine's events (one dp rank) -> ``KVCacheEvent`` s with our hashes."""

    def __init__(self, block_size: int, *, lora_name: str | None = None) -> None:
        self.block_size = block_size
        self.lora_name = lora_name
        self._ours: dict[int, int] = {}  # vLLM block hash (u64) -> our sequence hash
        self._next_id = 0

    @property
    def num_blocks(self) -> int:
        """Blocks the bridge knows are stored (tests: the router's view of this worker)."""
        return len(self._ours)

    def convert(self, events: list[list[Any]], dp_rank: int = 0) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for event in events:
            data = self._data(event)
            if data is not None:
                out.append(KVCacheEvent(event_id=self._next_id, data=data, dp_rank=dp_rank))
                self._next_id += 1
        return out

    def _data(self, event: list[Any]) -> BlocksStored | BlocksRemoved | AllBlocksCleared | None:
        kind = event[0] if event else None
        if kind == "BlockStored":
            return self._stored(event)
        if kind == "BlockRemoved":
            removed = [self._ours.pop(to_unsigned64(h), None) for h in event[1]]
            hashes = [h for h in removed if h is not None]
            return BlocksRemoved(block_hashes=hashes) if hashes else None
        if kind == "AllBlocksCleared":
            self._ours.clear()
            return AllBlocksCleared()
        log.debug("ignoring vLLM KV event %r", kind)
        return None

    def _stored(self, event: list[Any]) -> BlocksStored | None:
        vllm_hashes = [to_unsigned64(h) for h in event[1]]
        parent_vllm = None if event[2] is None else to_unsigned64(event[2])
        token_ids: list[int] = event[3]
        block_size: int = event[4]
        if block_size != self.block_size or len(token_ids) != block_size * len(vllm_hashes):
            log.warning(
                "vLLM stored blocks of %d tokens, not %d: skipped", block_size, self.block_size
            )
            return None
        parent = None
        if parent_vllm is not None:
            parent = self._ours.get(parent_vllm)
            if parent is None:  # a parent we never saw stored (events lost): cannot chain
                log.warning("vLLM stored a block whose parent is unknown: skipped")
                return None
        locals_ = local_block_hashes(token_ids, block_size, lora_name=self.lora_name)
        blocks: list[StoredBlock] = []
        prev = parent
        for vllm_hash, local in zip(vllm_hashes, locals_, strict=True):
            ours = local if prev is None else next_sequence_hash(prev, local)
            self._ours[vllm_hash] = ours
            blocks.append(StoredBlock(block_hash=ours, tokens_hash=local))
            prev = ours
        return BlocksStored(parent_hash=parent, blocks=blocks)

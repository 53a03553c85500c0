"""vLLM's KV events (FACTS §2.2: msgpack batches on its ZMQ publisher) as ours (FACTS §2.1).

vLLM names a block by its own hash; the router matches on the *local* block hash of
``router/hashing.py`` computed from the block's tokens, and finds parents and removals by the
worker's block id. The bridge recomputes both from the token ids vLLM sends: ``tokens_hash`` is
our local hash, ``block_hash`` our chained sequence hash (the ids the mocker and the PyTorch
engine publish), and it remembers vLLM's hash -> ours for the parents and removals that follow.
Event ids are the bridge's own, one per event, from 0.

vLLM 0.32 encodes each event as a msgpack *map* tagged ``{"type": "BlockStored", ...}`` (its
``KVCacheEvent`` is ``tag=True`` but not ``array_like``); Dynamo's mirror types and FACTS §2.2 use
the tagged *array* ``["BlockStored", hashes, parent, ...]``. Both are accepted. vLLM's hashes are
ints (i64 or u64: normalised to u64) by default, or raw bytes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (kept as opaque keys).

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


def decode_batch(payload: bytes) -> tuple[float, list[Any], int | None]:
    """``[ts, events, dp_rank?]`` -> (ts, events as vLLM sent them, dp_rank)."""
    raw = _decoder.decode(payload)
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("not a vLLM KV event batch")
    dp_rank = raw[2] if len(raw) > 2 else None
    return float(raw[0]), raw[1], dp_rank


VllmHash = int | bytes
"""vLLM's name for a block: a u64 (after normalising) or, with int hashes off, its raw bytes."""

# Field order of the tagged-array form (after the tag), FACTS §2.2.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def event_fields(event: Any) -> tuple[str | None, dict[str, Any]]:
    """One event as (kind, fields by name), from either wire form; ``(None, {})`` for what is
    not an event. Unknown trailing fields and map keys are ignored."""
    if isinstance(event, dict):
        kind = event.get("type")
        return (kind, event) if isinstance(kind, str) else (None, {})
    if isinstance(event, list) and event and isinstance(event[0], str):
        names = _ARRAY_FIELDS.get(event[0], ())
        return event[0], dict(zip(names, event[1:], strict=False))
    return None, {}


def _key(value: Any) -> VllmHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise TypeError(f"a vLLM block hash is an int or bytes, not {type(value).__name__}")
    return to_unsigned64(value) if isinstance(value, int) else value


class KVEventBridge:
    """One vLLM engine's events (one dp rank) -> ``KVCacheEvent`` s with our hashes."""

    def __init__(self, block_size: int, *, lora_name: str | None = None) -> None:
        self.block_size = block_size
        self.lora_name = lora_name
        self._ours: dict[VllmHash, int] = {}  # vLLM block hash -> our sequence hash
        self._next_id = 0

    @property
    def num_blocks(self) -> int:
        """Blocks the bridge knows are stored (tests: the router's view of this worker)."""
        return len(self._ours)

    def stored_hashes(self) -> set[int]:
        """Our sequence hashes of the blocks vLLM holds now, as the bridge has seen them."""
        return set(self._ours.values())

    def convert(self, events: list[Any], dp_rank: int = 0) -> list[KVCacheEvent]:
        """A batch's events, in order; a malformed event raises ``ValueError`` / ``TypeError``
        (the caller logs it and goes on with the next batch)."""
        out: list[KVCacheEvent] = []
        for event in events:
            data = self._data(event)
            if data is not None:
                out.append(KVCacheEvent(event_id=self._next_id, data=data, dp_rank=dp_rank))
                self._next_id += 1
        return out

    def _data(self, event: Any) -> BlocksStored | BlocksRemoved | AllBlocksCleared | None:
        kind, fields = event_fields(event)
        try:
            if kind == "BlockStored":
                return self._stored(fields)
            if kind == "BlockRemoved":
                removed = [self._ours.pop(_key(h), None) for h in fields["block_hashes"]]
                hashes = [h for h in removed if h is not None]
                return BlocksRemoved(block_hashes=hashes) if hashes else None
        except KeyError as exc:
            raise ValueError(f"vLLM {kind} event without {exc}") from exc
        if kind == "AllBlocksCleared":
            self._ours.clear()
            return AllBlocksCleared()
        log.debug("ignoring vLLM KV event %r", kind)
        return None

    def _stored(self, fields: dict[str, Any]) -> BlocksStored | None:
        vllm_hashes = [_key(h) for h in fields["block_hashes"]]
        parent_raw = fields["parent_block_hash"]
        token_ids: list[int] = fields["token_ids"]
        block_size: int = fields["block_size"]
        if block_size != self.block_size or len(token_ids) != block_size * len(vllm_hashes):
            log.warning(
                "vLLM stored blocks of %d tokens, not %d: skipped", block_size, self.block_size
            )
            return None
        parent = None
        if parent_raw is not None:
            parent = self._ours.get(_key(parent_raw))
            if parent is None:  # a parent we never saw stored (events lost): cannot chain
                log.warning("vLLM stored a block whose parent is unknown: skipped")
                return None
        lora_name = fields.get("lora_name") or self.lora_name  # the event's adapter, if any
        locals_ = local_block_hashes(token_ids, block_size, lora_name=lora_name)
        blocks: list[StoredBlock] = []
        prev = parent
        for vllm_hash, local in zip(vllm_hashes, locals_, strict=True):
            ours = local if prev is None else next_sequence_hash(prev, local)
            self._ours[vllm_hash] = ours
            blocks.append(StoredBlock(block_hash=ours, tokens_hash=local))
            prev = ours
        return BlocksStored(parent_hash=parent, blocks=blocks)

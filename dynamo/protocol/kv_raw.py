"""A pass's KV events as one compact buffer (the "raw" form), for an in-process consumer.

The offline replay moves every pass's KV events from the mocker's KV manager into the router's
index within one process. As msgspec structs (``KVCacheEvent`` > ``BlocksStored`` > a
``StoredBlock`` and two int objects per block) the events cost more to build, walk and free
than the tree's own work on them; the raw form is one ``bytes`` object a pass. A KV manager
records it only when asked (``KVManager.record_raw_events``; the live engines publish the
structs), and ``KVIndexer.apply_raw`` / ``RadixTree.apply_raw`` apply it. ``encode`` and
``decode`` convert between the two forms exactly (the Python twins and the tests use them).

Layout: unsigned 64-bit words in native byte order (``array('Q')``); ``b""`` holds no event.

* the buffer: ``dp_rank``, ``first_event_id``, ``count``, then ``count`` events whose ids are
  ``first_event_id``, ``first_event_id + 1``, ...
* an event: ``head``, its values, then (``NEG`` in ``head``) one word per value: 1 where that
  value was given as a negative int (it is then ``value - 2**64``), else 0.
* ``head = kind | HAS_PARENT | NEG | n << 8``: ``kind`` is ``STORED`` (values: the parent hash
  if ``HAS_PARENT``, then ``n`` pairs ``block_hash, tokens_hash``) or ``REMOVED`` (values: the
  ``n`` block hashes). There is no cleared kind (a KV manager never emits one).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

from dynamo.protocol.kv_events import BlocksRemoved, BlocksStored, KVCacheEvent, StoredBlock

STORED = 1
REMOVED = 2
HAS_PARENT = 4
NEG = 8
_MASK64 = (1 << 64) - 1
_HEADER = struct.Struct("=3Q")


def header(raw: bytes) -> tuple[int, int, int]:
    """``(dp_rank, first_event_id, count)`` of a non-empty buffer."""
    dp_rank, first, count = _HEADER.unpack_from(raw)
    return dp_rank, first, count


def encode(events: Sequence[KVCacheEvent]) -> bytes:
    """The raw form of consecutive events of one rank (``b""`` for none). ``ValueError`` for
    a cleared event, ids that do not follow each other, or mixed dp ranks; ``OverflowError``
    for a value outside ``[-2**63, 2**64)``."""
    if not events:
        return b""
    first = events[0]
    words = array("Q", (first.dp_rank, first.event_id, len(events)))
    for i, event in enumerate(events):
        if event.event_id != first.event_id + i or event.dp_rank != first.dp_rank:
            raise ValueError("raw events are consecutive events of one rank")
        data = event.data
        values: list[int] = []
        if type(data) is BlocksStored:
            kind = STORED
            if data.parent_hash is not None:
                kind |= HAS_PARENT
                values.append(data.parent_hash)
            for block in data.blocks:
                values += (block.block_hash, block.tokens_hash)
            n = len(data.blocks)
        elif type(data) is BlocksRemoved:
            kind, n = REMOVED, len(data.block_hashes)
            values += data.block_hashes
        else:
            raise ValueError("a cleared event has no raw form")
        for v in values:
            if not -(1 << 63) <= v <= _MASK64:
                raise OverflowError("raw event values must fit 64 bits")
        neg = [int(v < 0) for v in values]
        words.append(kind | (NEG if any(neg) else 0) | n << 8)
        words.extend(v & _MASK64 for v in values)
        if any(neg):
            words.extend(neg)
    return words.tobytes()


def decode(raw: bytes) -> list[KVCacheEvent]:
    """The events of a raw buffer (``encode``'s inverse). ``ValueError`` if it is malformed."""
    if not raw:
        return []
    if len(raw) % 8:
        raise ValueError("a raw event buffer is whole 64-bit words")
    words = array("Q", raw)
    if len(words) < 3:
        raise ValueError("a raw event buffer starts with three header words")
    dp_rank, first, count = words[0], words[1], words[2]
    events: list[KVCacheEvent] = []
    at = 3
    for i in range(count):
        if at >= len(words):
            raise ValueError("a raw event buffer ends early")
        head = words[at]
        kind, n = head & 3, head >> 8
        nvalues = n if kind == REMOVED else 2 * n + (1 if head & HAS_PARENT else 0)
        end = at + 1 + nvalues
        if kind not in (STORED, REMOVED) or end + (nvalues if head & NEG else 0) > len(words):
            raise ValueError("a malformed raw event")
        values = list(words[at + 1 : end])
        if head & NEG:
            flags = words[end : end + nvalues]
            values = [v - (1 << 64) if f else v for v, f in zip(values, flags, strict=True)]
            end += nvalues
        if kind == REMOVED:
            data: BlocksStored | BlocksRemoved = BlocksRemoved(block_hashes=values)
        else:
            parent = values.pop(0) if head & HAS_PARENT else None
            pairs = zip(values[0::2], values[1::2], strict=True)
            blocks = [StoredBlock(block_hash=b, tokens_hash=t) for b, t in pairs]
            data = BlocksStored(parent_hash=parent, blocks=blocks)
        events.append(KVCacheEvent(event_id=first + i, data=data, dp_rank=dp_rank))
        at = end
    if at != len(words):
        raise ValueError("a raw event buffer has trailing words")
    return events

"""vLLM's KV events (FACTS §2.2 wire batches) become ours with our block hashes, and the router's
index built from them matches a prefix exactly as one built from our own engines' events."""

from __future__ import annotations

import msgspec
import pytest

from dynamo.protocol.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, StoredBlock
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.router.indexer import EventStatus, KVIndexer
from dynamo.vllm.kv_bridge import KVEventBridge, decode_batch

BS = 4
_enc = msgspec.msgpack.Encoder()


def stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int = BS) -> list:
    # Newer vLLM appends optional fields (lora_name, mm infos, ...): consumers ignore them.
    return ["BlockStored", hashes, parent, tokens, bs, None, "GPU", None, None]


def test_stored_blocks_get_our_local_and_chained_hashes() -> None:
    tokens = list(range(1, 13))
    payload = _enc.encode([1.5, [stored([-5, 7], None, tokens[:8]), stored([9], 7, tokens[8:])], 0])
    ts, events, dp_rank = decode_batch(payload)
    assert (ts, dp_rank) == (1.5, 0)
    bridge = KVEventBridge(BS)
    out = bridge.convert(events)
    assert [e.event_id for e in out] == [0, 1]
    local = local_block_hashes(tokens, BS)
    chained = sequence_hashes(local)
    first, second = out[0].data, out[1].data
    assert isinstance(first, BlocksStored) and isinstance(second, BlocksStored)
    assert first.parent_hash is None
    assert [(b.block_hash, b.tokens_hash) for b in first.blocks] == list(
        zip(chained[:2], local[:2], strict=True)
    )
    assert second.parent_hash == chained[1]
    assert [(b.block_hash, b.tokens_hash) for b in second.blocks] == [(chained[2], local[2])]
    # A signed i64 hash and its u64 twin are the same block.
    removed = bridge.convert([["BlockRemoved", [(1 << 64) - 5], "GPU"]])[0].data
    assert removed == BlocksRemoved(block_hashes=[chained[0]])
    assert bridge.num_blocks == 2


def test_unknown_parent_wrong_size_and_unknown_kinds_are_skipped() -> None:
    bridge = KVEventBridge(BS)
    assert bridge.convert([stored([1], 99, [1, 2, 3, 4])]) == []  # parent never stored
    assert bridge.convert([stored([1], None, [1, 2, 3, 4, 5, 6, 7, 8], bs=8)]) == []
    assert bridge.convert([["SomethingNew", 1, 2]]) == []
    assert bridge.convert([["BlockRemoved", [12345], None]]) == []  # nothing we published
    cleared = bridge.convert([stored([1], None, [1, 2, 3, 4]), ["AllBlocksCleared"]])
    assert isinstance(cleared[1].data, AllBlocksCleared) and bridge.num_blocks == 0
    with pytest.raises(ValueError, match="not a vLLM KV event batch"):
        decode_batch(_enc.encode({"ts": 1}))


def test_the_router_matches_a_prefix_from_bridged_events() -> None:
    index = KVIndexer()
    bridge = KVEventBridge(BS)
    tokens = list(range(100, 116))  # 4 blocks
    events = bridge.convert([stored([11, 12], None, tokens[:8]), stored([13, 14], 12, tokens[8:])])
    assert [index.apply(3, e) for e in events] == [EventStatus.OK, EventStatus.OK]
    query = local_block_hashes(tokens[:12] + [1, 2, 3, 4], BS)
    assert index.find_matches(query) == {(3, 0): 3}
    for e in bridge.convert([["BlockRemoved", [14, 13], None]]):
        assert index.apply(3, e) is EventStatus.OK
    assert index.find_matches(query) == {(3, 0): 2}


def test_vllm_032_map_events_and_byte_hashes_are_read() -> None:
    """vLLM 0.32 sends each event as a map tagged ``type`` (its ``KVCacheEvent`` is not
    ``array_like``), with trailing fields of its own; hashes may be raw bytes."""
    tokens = list(range(1, 9))
    batch = [
        2.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [b"\x01" * 32],
                "parent_block_hash": None,
                "token_ids": tokens[:4],
                "block_size": BS,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
                "group_idx": 0,
            },
            {
                "type": "BlockStored",
                "block_hashes": [-3],
                "parent_block_hash": b"\x01" * 32,
                "token_ids": tokens[4:],
                "block_size": BS,
            },
            {"type": "BlockRemoved", "block_hashes": [(1 << 64) - 3], "medium": "CPU"},
        ],
    ]
    _, events, dp_rank = decode_batch(_enc.encode(batch))
    assert dp_rank is None
    bridge = KVEventBridge(BS)
    out = bridge.convert(events)
    chained = sequence_hashes(local_block_hashes(tokens, BS))
    assert [type(e.data) for e in out] == [BlocksStored, BlocksStored, BlocksRemoved]
    assert out[1].data == BlocksStored(
        parent_hash=chained[0],
        blocks=[StoredBlock(block_hash=chained[1], tokens_hash=local_block_hashes(tokens, BS)[1])],
    )
    assert out[2].data == BlocksRemoved(block_hashes=[chained[1]])
    assert bridge.stored_hashes() == {chained[0]}
    cleared = bridge.convert([{"type": "AllBlocksCleared"}])
    assert isinstance(cleared[0].data, AllBlocksCleared) and bridge.num_blocks == 0


def test_malformed_events_raise_value_or_type_errors() -> None:
    bridge = KVEventBridge(BS)
    with pytest.raises(ValueError, match="without"):
        bridge.convert([{"type": "BlockStored", "block_hashes": [1]}])
    with pytest.raises(TypeError, match="int or bytes"):
        bridge.convert([{"type": "BlockRemoved", "block_hashes": ["x"]}])
    assert bridge.convert([{"no": "type"}, 7, []]) == []

"""dynamo/_u64.h's digit read (an exact non-negative int of up to three 30-bit digits) against
the API conversion it short-cuts: every native module that reads block hashes gives the same
result for a value at each digit boundary as for the same value as an int subclass (which
takes the API path), and refuses what lies past 64 bits the same way."""

from __future__ import annotations

import pytest

BOUNDARIES = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63 - 1, 2**63, 2**64 - 1]


class Id(int):
    """The same value, not an exact int: converted through the API."""


def test_block_counts_read_boundaries_as_the_api() -> None:
    blocks = pytest.importorskip("dynamo.router._blocks")
    fast, slow = blocks.BlockCounts(BOUNDARIES), blocks.BlockCounts([Id(v) for v in BOUNDARIES])
    assert sorted(fast.items()) == sorted(slow.items())
    fast.add_prefixes(BOUNDARIES)
    slow.add_prefixes([Id(v) for v in BOUNDARIES])
    assert sorted(fast.items()) == sorted(slow.items())
    with pytest.raises(OverflowError):
        fast.add_prefixes([2**64])


def test_radix_tree_reads_boundaries_as_the_api() -> None:
    radix = pytest.importorskip("dynamo.router._radix")
    fast, slow = radix.RadixTree(), radix.RadixTree()
    assert fast.store_hashes(0, None, list(BOUNDARIES), list(BOUNDARIES))
    assert slow.store_hashes(0, None, [Id(v) for v in BOUNDARIES], [Id(v) for v in BOUNDARIES])
    assert fast.digest(0) == slow.digest(0)
    assert fast.find_matches(BOUNDARIES) == slow.find_matches([Id(v) for v in BOUNDARIES])
    assert fast.find_matches(BOUNDARIES) == {0: len(BOUNDARIES)}
    assert fast.find_matches([2**64]) == {}  # no block has such a hash
    with pytest.raises(OverflowError):
        fast.store_hashes(1, None, [2**64], [1])


def test_hashes_chain_boundaries_as_the_api() -> None:
    native = pytest.importorskip("dynamo.router._hash")
    assert native.sequence_hashes(BOUNDARIES) == native.sequence_hashes([Id(v) for v in BOUNDARIES])
    with pytest.raises(OverflowError):
        native.sequence_hashes([1, 2**64])


def test_kv_manager_reads_boundaries_as_the_api() -> None:
    kv = pytest.importorskip("dynamo.engine_core._kv")
    fast, slow = kv.KVManager(32), kv.KVManager(32)
    chain = BOUNDARIES[1:]  # distinct hashes
    fast.use(chain, list(range(len(chain))))
    slow.use([Id(v) for v in chain], list(range(len(chain))))
    assert fast.drain_events() == slow.drain_events()
    for v in chain:
        assert fast.slot_of(v) == slow.slot_of(Id(v)) == fast.slot_of(Id(v))

"""FACTS §1.3 test vectors for the local block hash and the chained sequence hash."""

from __future__ import annotations

import pytest

from dynamo.router.hashing import (
    XXH3_SEED,
    block_seed,
    local_block_hashes,
    next_sequence_hash,
    sequence_hashes,
    to_signed64,
    to_unsigned64,
)

R1_8 = list(range(1, 9))
H1 = 14643705804678351452
H2 = 16777012769546811212


@pytest.mark.parametrize(
    ("tokens", "bs", "kwargs", "expected"),
    [
        ([1, 2, 3, 4], 4, {}, [H1]),  # 1
        (R1_8, 4, {}, [H1, H2]),  # 2
        ([5, 6, 7, 8], 4, {}, [H2]),  # 3: position-independent
        (list(range(1, 11)), 4, {}, [H1, H2]),  # 4: tail dropped
        ([1, 2, 3], 4, {}, []),  # 5
        ([4294967295, 0, 1, 2], 4, {}, [6304548326766447106]),  # 6: u32 max
        (list(range(32)), 16, {}, [15310707395893867146, 15292316782987903195]),  # 7
        (list(range(32)), 32, {}, [5756925433886871916]),  # 8
        (list(range(64)), 32, {}, [5756925433886871916, 13958166640625465031]),  # 9
        (list(range(128)), 64, {}, [3480597578098033343, 3318286205056455972]),  # 10
        (R1_8, 4, {"lora_name": "my-lora"}, [15671544057904749233, 7919241211032067838]),  # 11
        (R1_8, 4, {"lora_name": ""}, [H1, H2]),  # 12
        (R1_8, 4, {"salt": "ns1"}, [6784473505686861528, 10836671426212506877]),  # 13
        (
            R1_8,
            4,
            {"lora_name": "my-lora", "salt": "ns1"},
            [8187777052900518599, 17970004876580536783],
        ),  # 14
        (list(range(1, 10)), 4, {"is_eagle": True}, [1914873892905420881, 1929047464662796003]),
        (R1_8, 4, {"is_eagle": True}, [1914873892905420881]),  # 16
        (R1_8, 4, {"block_mm_hashes": [[0xDEADBEEF], None]}, [15207512089340001072, H2]),  # 17
        (R1_8, 4, {"block_mm_hashes": [[7, 3]]}, [3497545641356191295, H2]),  # 18: sorted
    ],
)
def test_local_block_hash_vectors(
    tokens: list[int], bs: int, kwargs: dict[str, object], expected: list[int]
) -> None:
    assert local_block_hashes(tokens, bs, **kwargs) == expected  # type: ignore[arg-type]


def test_zero_block_size_and_short_input() -> None:
    assert local_block_hashes(R1_8, 0) == []
    assert local_block_hashes([], 4) == []
    assert local_block_hashes([1, 2, 3, 4], 4, is_eagle=True) == []  # no next-block token


def test_empty_salt_is_absent_and_seed_wraps() -> None:
    assert block_seed() == XXH3_SEED
    assert block_seed("", "") == XXH3_SEED
    assert 0 <= block_seed("my-lora", "ns1") < 2**64
    assert block_seed("my-lora") != block_seed(salt="my-lora")  # different seeds per term


def test_mm_hashes_leave_plain_blocks_alone() -> None:
    assert local_block_hashes(R1_8, 4, block_mm_hashes=[None, []]) == [H1, H2]


def test_sequence_hash_vectors_seed_1337() -> None:
    local = local_block_hashes(list(range(1, 13)), 4)
    assert local == [H1, H2, 483935686894639516]
    assert sequence_hashes(local) == [H1, 4945711292740353085, 12583592247330656132]
    local64 = local_block_hashes(list(range(64)), 32)
    assert sequence_hashes(local64) == [5756925433886871916, 16658382216643214443]
    assert next_sequence_hash(H1, H2) == 4945711292740353085
    assert sequence_hashes([]) == []


def test_signed_unsigned_roundtrip() -> None:
    for v in (0, 1, 2**63 - 1, 2**63, 2**64 - 1, H1):
        assert to_unsigned64(to_signed64(v)) == v
    assert to_signed64(2**64 - 1) == -1

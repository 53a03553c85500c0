"""router/_hash.c against its fallback (``_hash_fallback.py``, the Python ``xxhash`` package):
every block size and prompt length around XXH3's size classes (0-16, 17-128, 129-240 bytes and
the long path), random seeds, chained hashes, and the errors of bad ids. The native module is
skipped where it is not built; test_hashing.py's FACTS §1.3 vectors run on whichever is in use."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from dynamo.router import _hash_fallback as py
from dynamo.router import hashing


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.router._hash")


def test_block_hashes_match_for_every_size_class(native: ModuleType) -> None:
    rng = random.Random(5)
    for block_size in [*range(1, 70), 100, 128, 256, 1000]:
        seed = rng.choice([hashing.XXH3_SEED, 0, rng.randrange(1 << 64)])
        tokens = [rng.randrange(1 << 32) for _ in range(block_size * 3 + rng.randrange(block_size))]
        want = py.local_block_hashes(tokens, block_size, seed)
        assert native.local_block_hashes(tokens, block_size, seed) == want
        assert native.local_block_hashes(tuple(tokens), block_size, seed) == want
        assert native.block_hash(tokens[:block_size], seed) == py.block_hash(
            tokens[:block_size], seed
        )
    assert native.local_block_hashes([1, 2, 3], 0, 1337) == py.local_block_hashes(
        [1, 2, 3], 0, 1337
    )
    assert native.block_hash([], 9) == py.block_hash([], 9)


def test_sequence_hashes_match(native: ModuleType) -> None:
    rng = random.Random(6)
    for n in (0, 1, 2, 3, 72, 500):
        local = [rng.randrange(1 << 64) for _ in range(n)]
        assert native.sequence_hashes(local) == py.sequence_hashes(local)
    for _ in range(50):
        a, b = rng.randrange(1 << 64), rng.randrange(1 << 64)
        assert native.next_sequence_hash(a, b) == py.next_sequence_hash(a, b)
    # a lone first hash is never packed, so it is returned as given (as the fallback does)
    assert native.sequence_hashes([-1]) == py.sequence_hashes([-1]) == [-1]


@pytest.mark.parametrize("bad", [-1, 1 << 32])
def test_ids_outside_u32_are_refused_as_array_does(native: ModuleType, bad: int) -> None:
    for module in (native, py):
        with pytest.raises(OverflowError):
            module.local_block_hashes([1, 2, 3, bad], 2, 1337)
        with pytest.raises(OverflowError):
            module.local_block_hashes([1, 2, bad], 2, 1337)  # in the dropped tail too
        with pytest.raises(OverflowError):
            module.block_hash([bad], 1337)
    with pytest.raises(TypeError):
        native.local_block_hashes([1.5, 2], 2, 1337)
    with pytest.raises(TypeError):
        py.local_block_hashes([1.5, 2], 2, 1337)  # type: ignore[list-item]


def test_prompt_hashes_are_the_local_and_chained_hashes(native: ModuleType) -> None:
    rng = random.Random(7)
    for n in (0, 1, 15, 16, 17, 1152, 1153):
        for block_size in (1, 16, 64):
            # ids of every width: one 30-bit digit (read from it), two digits, 0
            tokens = [
                rng.choice([0, rng.randrange(1 << 30), rng.randrange(1 << 32)]) for _ in range(n)
            ]
            seed = rng.choice([hashing.XXH3_SEED, rng.randrange(1 << 64)])
            local = py.local_block_hashes(tokens, block_size, seed)
            want = (local, py.sequence_hashes(local))
            assert native.prompt_hashes(tokens, block_size, seed) == want
            assert py.prompt_hashes(tokens, block_size, seed) == want
            assert native.prompt_hashes(tuple(tokens), block_size, seed) == want
    assert native.prompt_hashes([1, 2], 0, 1) == py.prompt_hashes([1, 2], 0, 1) == ([], [])
    assert hashing.prompt_hashes([5] * 40, 16) == (
        hashing.local_block_hashes([5] * 40, 16),
        hashing.sequence_hashes(hashing.local_block_hashes([5] * 40, 16)),
    )
    assert hashing.prompt_hashes([5] * 40, 16, lora_name="a")[0] == hashing.local_block_hashes(
        [5] * 40, 16, lora_name="a"
    )


def test_token_ids_read_the_same_whatever_their_form(native: ModuleType) -> None:
    """An exact one-digit int is read from its digit; bools, int subclasses and wider ints go
    through the API: the same bytes, the same errors."""

    class Id(int):
        pass

    forms = [True, False, Id(7), (1 << 30) - 1, 1 << 30, (1 << 32) - 1, 0]
    for module in (native, py):
        assert module.prompt_hashes(forms, 1, 3) == native.prompt_hashes(
            [int(x) for x in forms], 1, 3
        )
        for bad in (-1, -(1 << 40), 1 << 32):
            with pytest.raises(OverflowError):
                module.prompt_hashes([1, bad], 1, 3)
    with pytest.raises(TypeError):
        native.prompt_hashes([1, "2"], 1, 3)
    with pytest.raises(TypeError):
        native.prompt_hashes([1, 2], 1)

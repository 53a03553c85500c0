"""router/_hash.c against its fallback (``_hash_fallback.py``, the Python ``xxhash`` package):
every block size and prompt length around XXH3's size classes (0-16, 17-128, 129-240 bytes and
the long path), random seeds, chained hashes, and the errors of bad ids. The native module is
skipped where it is not built; test_hashing.py's FACTS §1.3 vectors run on whichever is in use."""

from __future__ import annotations

import random
from array import array
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


def _shared_prompts(rng: random.Random, n: int, block_size: int) -> list[list[int]]:
    """Prompts around one base: its own objects for a prefix of any length (whole blocks or
    not), equal ids as other objects, a changed id, shorter and longer prompts."""
    base = [rng.randrange(1 << 32) for _ in range(n)]
    out: list[list[int]] = []
    for _ in range(12):
        cut = rng.randrange(n + 1)
        tail = [rng.randrange(1 << 32) for _ in range(rng.randrange(3 * block_size))]
        prompt = base[:cut] + tail
        if prompt and rng.random() < 0.3:  # an equal id, another object
            i = rng.randrange(len(prompt))
            prompt[i] = int(str(prompt[i]))
        if prompt and rng.random() < 0.3:  # a changed id inside the shared part
            i = rng.randrange(len(prompt))
            prompt[i] ^= 1
        out.append(prompt)
    return [base, *out]


@pytest.mark.parametrize("seed", range(8))
def test_prompt_hashes_after_a_known_prompt_are_prompt_hashes(
    native: ModuleType, seed: int
) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 3, 16, 64])
    salt = rng.choice([hashing.XXH3_SEED, rng.randrange(1 << 64)])
    prompts = _shared_prompts(rng, rng.randrange(4 * block_size), block_size)
    for known in prompts:
        k_local, k_chained = native.prompt_hashes(known, block_size, salt)
        for tokens in prompts:
            want = py.prompt_hashes(tokens, block_size, salt)
            for module in (native, py):
                got = module.prompt_hashes_after(
                    tokens, block_size, salt, known, k_local, tuple(k_chained)
                )
                assert got == want
    assert native.prompt_hashes_after([1, 2], 0, 1, [1, 2], [], []) == ([], [])
    assert py.prompt_hashes_after([1, 2], 0, 1, [1, 2], [], []) == ([], [])


@pytest.mark.parametrize("seed", range(4))
def test_packed_prompts_hash_as_their_lists(native: ModuleType, seed: int) -> None:
    """An ``array('I')`` prompt (the replay's packed prompts), as the prompt or the known one
    or both, hashes as its list (its ids read where they are, shared blocks compared a block
    at once)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 3, 16])
    prompts = _shared_prompts(rng, rng.randrange(4 * block_size), block_size)
    for known in prompts:
        k_local, k_chained = native.prompt_hashes(known, block_size, 1337)
        for tokens in prompts:
            want = py.prompt_hashes(tokens, block_size, 1337)
            for module in (native, py):
                assert module.prompt_hashes(array("I", tokens), block_size, 1337) == want
                for k, t in ((array("I", known), tokens), (known, array("I", tokens))):
                    assert (
                        module.prompt_hashes_after(t, block_size, 1337, k, k_local, k_chained)
                        == want
                    )
                packed = array("I", tokens), array("I", known)
                assert (
                    module.prompt_hashes_after(
                        *packed[:1], block_size, 1337, packed[1], k_local, k_chained
                    )
                    == want
                )


def test_prompt_hashes_after_checks_ids_and_its_arguments(native: ModuleType) -> None:
    known = [3, 4, 5, 6]
    k = native.prompt_hashes(known, 2, 1337)
    for module in (native, py):
        # a new id past the shared blocks is checked as prompt_hashes checks it
        with pytest.raises(OverflowError):
            module.prompt_hashes_after([3, 4, 5, -1], 2, 1337, known, *k)
        # a known item that is not an id only ends the shared blocks
        bad_known = [3, "x", 5, 6]
        assert module.prompt_hashes_after(
            [3, 4, 5, 6], 2, 1337, bad_known, *k
        ) == native.prompt_hashes([3, 4, 5, 6], 2, 1337)
    with pytest.raises(TypeError):
        native.prompt_hashes_after([3, 4], 2, 1337, known, k[0])
    with pytest.raises(TypeError):
        native.prompt_hashes_after([3, 4], 2, 1337, 5, *k)


def test_shared_prefix_hasher_reuses_a_keys_blocks() -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(50_000) for _ in range(64)]
    hasher = hashing.SharedPrefixHasher(16)
    for i in range(20):
        key = i % 3 if i % 5 else None
        tokens = (prefix if key != 1 else prefix[::-1]) + [rng.randrange(50_000) for _ in range(20)]
        local, chained = hasher.hashes(tokens, key)
        assert (local, chained) == hashing.prompt_hashes(tokens, 16)
        local.append(1)  # the caller's lists: the next prompt's hashes are not changed by it
        chained.clear()
    # the prefix blocks are the key's last prompt's own hash objects (reused, not recomputed)
    a = hasher.hashes([*prefix, 1], 0)[0]
    b = hasher.hashes([*prefix, 2], 0)[0]
    assert all(x is y for x, y in zip(a, b, strict=True))
    assert hashing.SharedPrefixHasher(0).hashes(prefix, 0) == ([], [])

"""Pure-Python twin of ``dynamo.router._hash`` (contract: ``_hash.pyi``), used where the
extension is not built or ``DYN_NATIVE=0``. Import through ``dynamo.router.hashing``."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
_PAIR = struct.Struct("<QQ")
_LITTLE = array("I").itemsize == 4 and struct.pack("=I", 1) == struct.pack("<I", 1)
_SEQUENCE_SEED = 1337  # router.hashing.XXH3_SEED


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian bytes (OverflowError outside [0, 2**32))."""
    arr = array("I", tokens)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def local_block_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    if block_size <= 0:
        return []
    data = token_bytes(tokens)
    step = block_size * 4
    return [_xxh3(data[i * step : (i + 1) * step], seed) for i in range(len(tokens) // block_size)]


def prompt_hashes(tokens: Sequence[int], block_size: int, seed: int) -> tuple[list[int], list[int]]:
    local = local_block_hashes(tokens, block_size, seed)
    return local, sequence_hashes(local)


def prompt_hashes_after(
    tokens: Sequence[int],
    block_size: int,
    seed: int,
    known_tokens: Sequence[int],
    known_local: Sequence[int],
    known_chained: Sequence[int],
) -> tuple[list[int], list[int]]:
    if block_size <= 0:
        return [], []
    data = token_bytes(tokens)  # every id checked, as prompt_hashes
    step = block_size * 4
    blocks = len(tokens) // block_size
    limit = min(blocks, len(known_tokens) // block_size, len(known_local), len(known_chained))
    shared = 0
    while shared < limit and _same_ids(data, known_tokens, shared * block_size, block_size):
        shared += 1
    local = [*known_local[:shared]]
    local += [_xxh3(data[i * step : (i + 1) * step], seed) for i in range(shared, blocks)]
    chained = [*known_chained[:shared]]
    prev = chained[-1] if chained else None
    for value in local[shared:]:
        prev = value if prev is None else _xxh3(_PAIR.pack(prev, value), _SEQUENCE_SEED)
        chained.append(prev)
    return local, chained


def _same_ids(data: bytes, known: Sequence[int], lo: int, n: int) -> bool:
    """Whether ``known[lo:lo + n]`` are the ids of ``data``'s; a known item that is not a valid
    id is a difference (as ``_hash.c``)."""
    try:
        return token_bytes(known[lo : lo + n]) == data[4 * lo : 4 * (lo + n)]
    except (TypeError, OverflowError, ValueError):
        return False


def sequence_hashes(local_hashes: Sequence[int]) -> list[int]:
    out: list[int] = []
    prev: int | None = None
    for local in local_hashes:
        prev = local if prev is None else _xxh3(_PAIR.pack(prev, local), _SEQUENCE_SEED)
        out.append(prev)
    return out


def block_hash(tokens: Sequence[int], seed: int) -> int:
    return _xxh3(token_bytes(tokens), seed)


def next_sequence_hash(parent: int, local: int) -> int:
    return _xxh3(_PAIR.pack(parent, local), _SEQUENCE_SEED)

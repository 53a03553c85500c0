"""Type stub of the native module ``dynamo.router._hash`` (source: ``_hash.c``; the same
contract in Python: ``_hash_fallback.py``). Import through ``dynamo.router.hashing``."""

from collections.abc import Sequence

def local_block_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """XXH3-64 (``seed``) of each complete block of ``tokens`` as u32 little-endian bytes; the
    partial tail is dropped (but its ids are checked). ``[]`` for ``block_size <= 0``.
    OverflowError for an id outside [0, 2**32)."""

def prompt_hashes(tokens: Sequence[int], block_size: int, seed: int) -> tuple[list[int], list[int]]:
    """``(local, sequence_hashes(local))`` for ``local = local_block_hashes(tokens, block_size,
    seed)``, in one call (the chain from the same 64-bit values, not converted back)."""

def prompt_hashes_after(
    tokens: Sequence[int],
    block_size: int,
    seed: int,
    known_tokens: Sequence[int],
    known_local: Sequence[int],
    known_chained: Sequence[int],
) -> tuple[list[int], list[int]]:
    """``prompt_hashes(tokens, block_size, seed)``, taking the hash objects of ``known_local`` /
    ``known_chained`` for the leading complete blocks whose ids equal ``known_tokens``' (the
    same objects or equal values) instead of hashing them. Precondition (not checked):
    ``(known_local, known_chained) == prompt_hashes(known_tokens, block_size, seed)``. Every id
    of ``tokens`` is checked as ``prompt_hashes`` checks it; a known item that is not a valid id
    only ends the shared blocks."""

def sequence_hashes(local_hashes: Sequence[int]) -> list[int]:
    """Chained hashes: ``seq[0] = local[0]``, ``seq[i] = next_sequence_hash(seq[i-1],
    local[i])``."""

def block_hash(tokens: Sequence[int], seed: int) -> int:
    """XXH3-64 (``seed``) of ``tokens`` as u32 little-endian bytes."""

def next_sequence_hash(parent: int, local: int) -> int:
    """XXH3-64 (seed 1337) of ``u64_le(parent) || u64_le(local)``."""

"""KV block hashing (FACTS §1), shared by the router and the engines (mocker).

* local block hash = XXH3-64 of the block's tokens as u32 little-endian, seed 1337 (LoRA name and
  cache salt are mixed into the seed); only complete blocks are hashed.
* sequence hash: ``seq[0] = local[0]``, ``seq[i] = XXH3-64(u64_le(seq[i-1]) || u64_le(local[i]),
  seed 1337)``. It identifies a block *with its whole prefix*.

The per-block loops run in ``_hash.c``, or its pure-Python twin ``_hash_fallback.py`` (chosen
once by ``dynamo.native``); the rare forms (EAGLE windows, multimodal hashes) are built here.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from dynamo import native
from dynamo.router import _hash_fallback

XXH3_SEED = 1337
_MASK64 = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest

_impl = native.load(
    "dynamo.router._hash",
    "dynamo.router._hash_fallback",
    requires=("prompt_hashes", "prompt_hashes_after"),
)
IMPLEMENTATION: str = _impl.__name__
"""The module in use (``dynamo.router._hash`` or ``dynamo.router._hash_fallback``)."""
if TYPE_CHECKING:
    from dynamo.router._hash import block_hash as _block_hash
    from dynamo.router._hash import local_block_hashes as _plain_hashes
    from dynamo.router._hash import next_sequence_hash as _next
    from dynamo.router._hash import prompt_hashes as _plain_pair
    from dynamo.router._hash import prompt_hashes_after as _pair_after
    from dynamo.router._hash import sequence_hashes as _chain
else:
    _block_hash, _plain_hashes = _impl.block_hash, _impl.local_block_hashes
    _next, _chain = _impl.next_sequence_hash, _impl.sequence_hashes
    _plain_pair, _pair_after = _impl.prompt_hashes, _impl.prompt_hashes_after


def block_seed(lora_name: str | None = None, salt: str | None = None) -> int:
    """The hash seed: 1337, plus the LoRA name's and salt's hashes (wrapping u64 addition)."""
    seed = XXH3_SEED
    if lora_name:
        seed += _xxh3(lora_name.encode(), 0)
    if salt:
        seed += _xxh3(salt.encode(), 1)
    return seed & _MASK64


def local_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    salt: str | None = None,
    is_eagle: bool = False,
    block_mm_hashes: Sequence[Sequence[int] | None] | None = None,
) -> list[int]:
    """Local hashes of every complete block of ``tokens`` (the partial tail is dropped).

    ``is_eagle``: each block's window also takes the next block's first token (stride unchanged).
    ``block_mm_hashes[i]``: multimodal object hashes of block i, appended to its bytes as u64 LE in
    ascending order (None or empty: a plain block).
    """
    if block_size <= 0:
        return []
    seed = block_seed(lora_name, salt)
    if not is_eagle and not block_mm_hashes:
        return _plain_hashes(tokens, block_size, seed)
    data = _hash_fallback.token_bytes(tokens)
    step = block_size * 4
    if is_eagle:
        n_blocks = max(0, (len(tokens) - 1) // block_size)
        width = step + 4
    else:
        n_blocks = len(tokens) // block_size
        width = step
    out = [_xxh3(data[i * step : i * step + width], seed) for i in range(n_blocks)]
    if block_mm_hashes:
        for i, mm in enumerate(block_mm_hashes[:n_blocks]):
            if mm:
                extra = b"".join(struct.pack("<Q", h & _MASK64) for h in sorted(mm))
                out[i] = _xxh3(data[i * step : i * step + width] + extra, seed)
    return out


def prompt_hashes(
    tokens: Sequence[int], block_size: int, *, lora_name: str | None = None
) -> tuple[list[int], list[int]]:
    """``(local, sequence_hashes(local))`` of a plain prompt (no EAGLE window, no multimodal
    hashes), ``local`` as :func:`local_block_hashes`; one native call (the offline replay
    hashes every request so)."""
    if block_size <= 0:
        return [], []
    return _plain_pair(tokens, block_size, block_seed(lora_name))


class SharedPrefixHasher:
    """:func:`prompt_hashes` of a stream of plain prompts, each under a key (the offline
    replay's prefix group): a prompt reuses the hashes of the leading complete blocks it shares
    with the last prompt of its key (compared id by id in ``_hash.c``: the result is always
    ``prompt_hashes``'s), so a group's common prefix is hashed once, not per request.

    The last prompt of each key is kept to compare with: the caller must not change a prompt
    after handing it in (the replay's prompts are never changed: an engine sequence keeps its
    prompt and never changes it)."""

    def __init__(self, block_size: int, *, lora_name: str | None = None) -> None:
        self.block_size = block_size
        self._seed = block_seed(lora_name)
        self._last: dict[int, tuple[Sequence[int], tuple[int, ...], tuple[int, ...]]] = {}

    def hashes(self, tokens: Sequence[int], key: int | None) -> tuple[list[int], list[int]]:
        """``prompt_hashes(tokens, block_size)``; ``key`` None: nothing kept or reused."""
        if self.block_size <= 0:
            return [], []
        last = None if key is None else self._last.get(key)
        if last is None:
            local, chained = _plain_pair(tokens, self.block_size, self._seed)
        else:
            local, chained = _pair_after(tokens, self.block_size, self._seed, *last)
        if key is not None:  # tuples: the returned lists are the caller's to change
            self._last[key] = (tokens, tuple(local), tuple(chained))
        return local, chained


def block_hash(tokens: Sequence[int], seed: int = XXH3_SEED) -> int:
    """The local hash of one complete block (``seed`` from :func:`block_seed`): what
    ``local_block_hashes`` computes per block, for callers that hash one block at a time (a
    decode filling its tail block)."""
    return _block_hash(tokens, seed)


def next_sequence_hash(parent: int, local: int) -> int:
    """The sequence hash of the block ``local`` after the block whose sequence hash is
    ``parent``."""
    return _next(parent, local)


def sequence_hashes(local_hashes: Sequence[int]) -> list[int]:
    """Chain local hashes into sequence hashes."""
    return _chain(local_hashes)


def to_signed64(value: int) -> int:
    """u64 -> i64 bit-for-bit (for JSON peers that use signed integers)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def to_unsigned64(value: int) -> int:
    """i64 -> u64 bit-for-bit."""
    return value & _MASK64

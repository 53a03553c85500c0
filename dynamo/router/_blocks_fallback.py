"""Pure-Python ``BlockCounts`` and ``prefix_keys``: the contract of ``_blocks.pyi`` without C.

Used where ``_blocks.c`` is not built or ``DYN_NATIVE=0`` (see ``dynamo.native``); slower, same
answers and errors (the unit tests run against both). Keys are held in a dict, scrambled by a
per-process random odd multiplier first: Python's int hash is the value modulo 2**61 - 1, so raw
keys chosen by a client could all share one hash and make every probe a linear scan. Prefix keys
use the native module's chain function with their own per-process seed.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Final

import msgspec

_U64: Final = (1 << 64) - 1
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1

_seeds = int.from_bytes(os.urandom(16), "little")
_SCRAMBLE: Final = (_seeds & _U64) | 1  # odd: a bijection of the 64-bit keys
_UNSCRAMBLE: Final = pow(_SCRAMBLE, -1, 1 << 64)
_CHAIN_SEED: Final = _seeds >> 64


def _as_key(obj: object) -> int:
    """The unsigned 64-bit pattern of a hash (TypeError / OverflowError as the native one)."""
    if not isinstance(obj, int):
        raise TypeError(f"block hashes must be int, not {type(obj).__name__}")
    if _I64_MIN <= obj <= _U64:
        return obj & _U64
    raise OverflowError("block hash outside the signed and unsigned 64-bit ranges")


def _chain(parent: int, key: int) -> int:
    """The prefix key of (the prefix named by ``parent``) + ``key`` (``_blocks.c``'s chain)."""
    x = ((parent * 0x9E3779B97F4A7C15) & _U64) ^ key ^ _CHAIN_SEED
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _U64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _U64
    return x ^ (x >> 33)


def _prefixes(hashes: Iterable[int]) -> Iterator[int]:
    parent = 0
    for h in hashes:
        parent = _chain(parent, _as_key(h))
        yield parent


def prefix_keys(hashes: Iterable[int]) -> list[int]:
    """The unsigned prefix key of each position: ``key[i] = chain(key[i-1], hashes[i])``."""
    if not isinstance(hashes, Iterable):
        raise TypeError("prefix_keys() takes an iterable of int")
    return list(_prefixes(hashes))


def prefix_key_bytes(hashes: Iterable[int]) -> bytes:
    """``prefix_keys`` packed as native-endian unsigned 64-bit integers."""
    if not isinstance(hashes, Iterable):
        raise TypeError("prefix_key_bytes() takes an iterable of int")
    return array("Q", _prefixes(hashes)).tobytes()


def _unpack(keys: bytes, what: str) -> list[int]:
    """The keys of a ``prefix_key_bytes`` buffer (TypeError / ValueError as the native one)."""
    if not isinstance(keys, bytes):
        raise TypeError(f"{what} takes the bytes of prefix_key_bytes(), not {type(keys).__name__}")
    if len(keys) % 8:
        raise ValueError(f"{what}: {len(keys)} bytes are not whole 64-bit keys")
    out = array("Q")
    out.frombytes(keys)
    return out.tolist()


def new_blocks(tables: Sequence[BlockCounts], hashes: Iterable[int]) -> list[int]:
    """Per table (holding whole trie paths), the blocks of ``hashes`` past the longest prefix
    of them that is a node there (``_blocks.c``'s walk from the root)."""
    return _walk(tables, prefix_keys(hashes))


def new_blocks_of_keys(tables: Sequence[BlockCounts], keys: bytes) -> list[int]:
    """``new_blocks`` of the hashes whose ``prefix_key_bytes`` are ``keys``."""
    return _walk(tables, _unpack(keys, "new_blocks_of_keys()"))


def _walk(tables: Sequence[BlockCounts], keys: list[int]) -> list[int]:
    n = len(keys)
    out: list[int] = []
    for table in tables:
        if not isinstance(table, BlockCounts):
            raise TypeError(f"new_blocks() takes BlockCounts, not {type(table).__name__}")
    for table in tables:
        counts = table._counts  # noqa: SLF001 - the same module's table
        depth = 0
        if counts:
            while depth < n and (keys[depth] * _SCRAMBLE) & _U64 in counts:
                depth += 1
        out.append(n - depth)
    return out


class BlockCounts:
    """A multiset of 64-bit block hashes with a count per hash (see ``_blocks.pyi``)."""

    __slots__ = ("_counts", "_high")

    def __init__(self, hashes: Iterable[int] = ()) -> None:
        # Scrambled key -> count; ``_high`` is the most keys held since the dict was last
        # rebuilt (a dict never shrinks by itself: ``remove`` rebuilds it when sparse).
        self._counts: dict[int, int] = {}
        self._high = 0
        self.add(hashes)

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview | msgspec.Raw) -> BlockCounts:
        """The hashes of a JSON array of integers in the signed 64-bit range."""
        table = cls()
        table.add(_parse_json(data))
        return table

    @classmethod
    def prefixes_from_json(cls, data: bytes | bytearray | memoryview | msgspec.Raw) -> BlockCounts:
        """The prefix keys of a JSON array; errors as ``from_json``."""
        return cls.of_prefixes(_parse_json(data))

    @classmethod
    def of_prefixes(cls, hashes: Iterable[int]) -> BlockCounts:
        """A table holding the prefix key of each position of ``hashes``."""
        table = cls()
        table.add_prefixes(hashes)
        return table

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, obj: object) -> bool:
        try:
            key = _as_key(obj)
        except (TypeError, OverflowError):
            return False  # not a 64-bit int: never held
        return (key * _SCRAMBLE) & _U64 in self._counts

    def __repr__(self) -> str:
        return f"BlockCounts(<{len(self._counts)} blocks>)"

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + self._counts.__sizeof__()

    def _add_keys(self, keys: Iterable[int]) -> None:
        counts = self._counts
        get = counts.get
        try:
            for key in keys:
                key = (key * _SCRAMBLE) & _U64
                counts[key] = get(key, 0) + 1
        finally:  # an error mid-way keeps what was added, as the native table does
            if len(counts) > self._high:
                self._high = len(counts)

    def _remove_keys(self, keys: Iterable[int]) -> None:
        counts = self._counts
        try:
            for key in keys:
                slot = (key * _SCRAMBLE) & _U64
                count = counts.get(slot, 0)
                if count == 0:
                    raise KeyError(key)
                if count == 1:
                    del counts[slot]
                else:
                    counts[slot] = count - 1
        finally:
            if len(counts) * 8 < self._high:  # sparse: give the memory back
                self._counts = dict(counts.items())
                self._high = len(counts)

    def add(self, hashes: Iterable[int]) -> None:
        """One more holder of each hash (a repeated hash counts twice)."""
        self._add_keys(map(_as_key, hashes))

    def remove(self, hashes: Iterable[int]) -> None:
        """One holder less of each hash; KeyError on a hash that is not held."""
        self._remove_keys(map(_as_key, hashes))

    def add_prefixes(self, hashes: Iterable[int]) -> None:
        """One more holder of the prefix key of each position of ``hashes``."""
        self._add_keys(_prefixes(hashes))

    def remove_prefixes(self, hashes: Iterable[int]) -> None:
        """One holder less of each prefix key of ``hashes``; KeyError on one not held."""
        self._remove_keys(_prefixes(hashes))

    def add_prefix_keys(self, keys: bytes) -> None:
        """``add_prefixes`` of the hashes whose ``prefix_key_bytes`` are ``keys``."""
        self._add_keys(_unpack(keys, "add_prefix_keys()"))

    def remove_prefix_keys(self, keys: bytes) -> None:
        """``remove_prefixes`` of the hashes whose ``prefix_key_bytes`` are ``keys``."""
        self._remove_keys(_unpack(keys, "remove_prefix_keys()"))

    def count(self, hash: int) -> int:
        """The hash's count, 0 if absent."""
        return self._counts.get((_as_key(hash) * _SCRAMBLE) & _U64, 0)

    def count_absent(self, query: BlockCounts) -> int:
        """How many distinct hashes of ``query`` are absent here."""
        if not isinstance(query, BlockCounts):
            raise TypeError(f"count_absent() takes BlockCounts, not {type(query).__name__}")
        held = self._counts
        if not held:
            return len(query._counts)
        return len(query._counts.keys() - held.keys())

    def items(self) -> list[tuple[int, int]]:
        """``(unsigned hash, count)`` pairs, in no particular order."""
        return [((key * _UNSCRAMBLE) & _U64, count) for key, count in self._counts.items()]

    def clear(self) -> None:
        self._counts = {}
        self._high = 0


# ------------------------------------------------------------ from a JSON array of ints

_I64_LIST = msgspec.json.Decoder(list[Annotated[int, msgspec.Meta(ge=_I64_MIN, le=_I64_MAX)]])
_WS = b" \t\n\r"
_DIGITS = b"0123456789"


def _parse_json(data: bytes | bytearray | memoryview | msgspec.Raw) -> list[int]:
    """The ints of a JSON array in the signed 64-bit range; ValueError as ``_blocks.c``.

    msgspec accepts exactly the documents the native parser accepts (a unit test compares
    them), so it decodes; a rejected document is parsed again here for the native message.
    """
    doc = bytes(memoryview(data))  # TypeError for what is not bytes-like, as the native one
    try:
        return _I64_LIST.decode(doc)
    except msgspec.MsgspecError:
        pass
    _explain(doc)
    raise ValueError("Expected `array` of `int`")  # not reached: _explain raised


def _error(index: int, what: str) -> ValueError:
    return ValueError(what if index < 0 else f"{what} - at `[{index}]`")


def _skip_ws(doc: bytes, p: int) -> int:
    while p < len(doc) and doc[p] in _WS:
        p += 1
    return p


def _explain(doc: bytes) -> None:
    """Raise the native parser's ValueError for the first error of ``doc`` (if any)."""
    end = len(doc)
    p = _skip_ws(doc, 0)
    if p >= end or doc[p] != ord("["):
        raise _error(-1, "Expected `array` of `int`")
    p = _skip_ws(doc, p + 1)
    index = 0
    if p < end and doc[p] == ord("]"):
        p += 1
    else:
        while True:
            p = _parse_int(doc, p, index)
            index += 1
            p = _skip_ws(doc, p)
            if p < end and doc[p] == ord(","):
                p = _skip_ws(doc, p + 1)
                continue
            if p < end and doc[p] == ord("]"):
                p += 1
                break
            raise _error(index, "Expected `,` or `]` after an array element")
    if _skip_ws(doc, p) != end:
        raise _error(-1, "Trailing characters after the array")


def _parse_int(doc: bytes, p: int, index: int) -> int:
    """Past one JSON integer in the signed 64-bit range at ``p``; ValueError otherwise."""
    end = len(doc)
    negative = p < end and doc[p] == ord("-")
    if negative:
        p += 1
    if p >= end or doc[p] not in _DIGITS:
        raise _error(index, "Expected `int`")
    if doc[p] == ord("0") and p + 1 < end and doc[p + 1] in _DIGITS:
        raise _error(index, "Expected `int`, got a number with a leading zero")
    start = p
    while p < end and doc[p] in _DIGITS:
        p += 1
    magnitude = int(doc[start:p]) if p - start <= 40 else 1 << 64
    if magnitude > _U64:  # the native parser stops at the digit that overflows 64 bits
        raise _error(index, "Expected `int` in the signed 64-bit range")
    if p < end and doc[p] in b".eE":
        raise _error(index, "Expected `int`, got `float`")
    if magnitude > (1 << 63 if negative else _I64_MAX):
        raise _error(index, "Expected `int` in the signed 64-bit range")
    return p

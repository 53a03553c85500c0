"""Type stub of the native module ``dynamo.router._blocks`` (source: ``_blocks.c``)."""

from collections.abc import Iterable, Sequence

from msgspec import Raw

class BlockCounts:
    """A multiset of 64-bit block hashes with a count per hash.

    A hash is an int in the signed or unsigned 64-bit range; both forms of one bit pattern are
    the same hash (``items()`` gives the unsigned form). ``len()`` is the number of distinct
    hashes.
    """

    def __init__(self, hashes: Iterable[int] = ...) -> None: ...
    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview | Raw) -> BlockCounts:
        """The hashes of a JSON array of integers in the signed 64-bit range.

        ``data`` is bytes-like (a ``msgspec.Raw`` works). ValueError, naming the element
        (``- at `[3]```), on anything else: not an array, a float, a string, out of range.
        """
    @classmethod
    def prefixes_from_json(cls, data: bytes | bytearray | memoryview | Raw) -> BlockCounts:
        """The prefix keys (see ``prefix_keys``) of a JSON array; errors as ``from_json``."""
    @classmethod
    def of_prefixes(cls, hashes: Iterable[int]) -> BlockCounts:
        """A table holding the prefix key of each position of ``hashes``."""
    def __len__(self) -> int: ...
    def __contains__(self, hash: object) -> bool: ...
    def add(self, hashes: Iterable[int]) -> None:
        """One more holder of each hash (a repeated hash counts twice)."""
    def remove(self, hashes: Iterable[int]) -> None:
        """One holder less of each hash; KeyError on a hash that is not held."""
    def add_prefixes(self, hashes: Iterable[int]) -> None:
        """One more holder of the prefix key of each position of ``hashes`` (a trie path)."""
    def remove_prefixes(self, hashes: Iterable[int]) -> None:
        """One holder less of each prefix key of ``hashes``; KeyError on one that is not held."""
    def add_prefix_keys(self, keys: bytes) -> None:
        """``add_prefixes`` of the hashes whose ``prefix_key_bytes`` are ``keys`` (no chaining).

        TypeError for what is not ``bytes``, ValueError for a length that is not whole keys.
        """
    def remove_prefix_keys(self, keys: bytes) -> None:
        """``remove_prefixes`` of the hashes whose ``prefix_key_bytes`` are ``keys``; KeyError
        on one that is not held (those before it stay removed); errors as ``add_prefix_keys``."""
    def count(self, hash: int) -> int:
        """The hash's count, 0 if absent."""
    def count_absent(self, query: BlockCounts) -> int:
        """How many distinct hashes of ``query`` are absent here."""
    def items(self) -> list[tuple[int, int]]:
        """``(unsigned hash, count)`` pairs, in no particular order."""
    def clear(self) -> None: ...

def prefix_keys(hashes: Iterable[int]) -> list[int]:
    """The unsigned prefix key of each position: ``key[i] = chain(key[i-1], hashes[i])``.

    A key names the whole prefix ``hashes[:i+1]`` (a trie node); the chain is seeded per
    process, so keys are only comparable within one process and one implementation.
    """

def prefix_key_bytes(hashes: Iterable[int]) -> bytes:
    """``prefix_keys`` packed as native-endian unsigned 64-bit integers in one ``bytes``: what a
    request's load accounting keeps, so that the route's walk (``new_blocks_of_keys``), the
    record (``add_prefix_keys``) and the free (``remove_prefix_keys``) chain its hashes once.
    Only meaningful to the implementation (and process) that made it.
    """

def new_blocks_of_keys(tables: Sequence[BlockCounts], keys: bytes) -> list[int]:
    """``new_blocks`` of the hashes whose ``prefix_key_bytes`` are ``keys``; errors as
    ``BlockCounts.add_prefix_keys``."""

def new_blocks(tables: Sequence[BlockCounts], hashes: Iterable[int]) -> list[int]:
    """Per table, the blocks of a request (``hashes``, in order) outside the trie it holds:
    ``len(hashes)`` minus the depth of the longest prefix of them that is a node there.

    The tables must hold whole trie paths (``add_prefixes``; ``ActiveSequences`` does): the
    request's nodes present in one are then a leading run, and the walk stops at the first
    absent one. Equals ``table.count_absent(BlockCounts.of_prefixes(hashes))`` on such tables.
    """

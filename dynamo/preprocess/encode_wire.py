"""The messages between the frontend and its tokenizer process (``encode_process.py`` /
``encode_child.py``), over one stream socket: each a 4-byte little-endian length, then msgpack.

The child answers batches in order, and reads a whole batch before it writes its reply; the
parent never blocks on a write (what the socket does not take waits in its buffer) and always
reads. So neither end can wait on the other with both sockets full: the child may block in
its write only while the parent, which keeps reading, drains it.
"""

from __future__ import annotations

import struct

import msgspec

HEADER = struct.Struct("<I")
"""The length prefix of every message."""
MAX_MESSAGE_BYTES = 1 << 30
"""A larger length prefix is a broken stream, not a message (the parent bounds its batches)."""


class TokenizerLoad(msgspec.Struct, array_like=True, frozen=True):
    """A tokenizer the child keeps under ``key`` until dropped: ``serialized`` is its
    ``tokenizer.json`` text (sent once per tokenizer and child)."""

    key: int
    serialized: str


class EncodeGroup(msgspec.Struct, array_like=True, frozen=True):
    """Texts encoded by one tokenizer with one ``add_special_tokens`` flag (one
    ``encode_batch`` call)."""

    key: int
    add_special_tokens: bool
    texts: list[str]


class EncodeBatch(msgspec.Struct, array_like=True, frozen=True):
    """Parent -> child: tokenizers to load and to forget (before the groups), then the
    groups."""

    loads: list[TokenizerLoad]
    drops: list[int]
    groups: list[EncodeGroup]


class GroupIds(msgspec.Struct, array_like=True, frozen=True):
    """The ids of a group's texts, in order; ``failed``: the indexes of the texts the child
    could not encode (their ids are ``[]``; the parent encodes them itself, which raises the
    tokenizer's own error for the request)."""

    ids: list[list[int]]
    failed: list[int]


class EncodeReply(msgspec.Struct, array_like=True, frozen=True):
    """Child -> parent: one :class:`GroupIds` per group of the batch, in order."""

    groups: list[GroupIds]


def frame(payload: bytes) -> bytes:
    """``payload`` with its length prefix."""
    return HEADER.pack(len(payload)) + payload


def frame_length(header: bytes | bytearray | memoryview) -> int:
    """The payload length a message header announces; ValueError past
    :data:`MAX_MESSAGE_BYTES`."""
    (length,) = HEADER.unpack_from(header)
    if length > MAX_MESSAGE_BYTES:
        raise ValueError(f"a tokenizer-process message of {length} bytes: the stream is broken")
    return int(length)

"""Request-plane framing: a fixed 16-byte prefix, an optional msgpack header, then the body.

Owns the wire format of the TCP request plane and the ``Annotated`` encoding of response bodies;
it knows nothing about sockets or streams.

::

    0      1      2        4           8            12           16
    +------+------+--------+-----------+------------+------------+--------+------+
    | 0xD7 | kind |  arg   | stream_id | header_len |  body_len  | header | body |
    +------+------+--------+-----------+------------+------------+--------+------+
    big-endian; u8, u8, u16, u32, u32, u32

    REQUEST   client -> server  header = RequestHeader (msgpack), body = request body
    RESPONSE  server -> client  body = msgpack Annotated[bytes] (data, complete_final or error);
                                stream 0 carries a connection-level error before a close
    CANCEL    client -> server  arg = CANCEL_STOP | CANCEL_KILL | CANCEL_RESET
    CREDIT    client -> server  arg = frames the client consumed (flow-control window update)

``header_len + body_len`` is the message size, checked against ``max_frame_size``.
"""

from __future__ import annotations

import struct
from typing import Final

import msgspec

from dynamo.protocol.annotated import Annotated
from dynamo.runtime.errors import DynamoError, from_kind

MAGIC: Final = 0xD7
PREFIX: Final = struct.Struct(">BBHIII")
PREFIX_SIZE: Final = PREFIX.size

REQUEST: Final = 1
RESPONSE: Final = 2
CANCEL: Final = 3
CREDIT: Final = 4
_KINDS: Final = frozenset((REQUEST, RESPONSE, CANCEL, CREDIT))

CANCEL_STOP: Final = 1
"""The caller's context was stopped: stop generating gracefully."""
CANCEL_KILL: Final = 2
"""The caller's context was killed: stop at once (the caller still reads the stream's end)."""
CANCEL_RESET: Final = 3
"""The caller stopped reading: kill, and send nothing more for this stream."""

MAX_ARG: Final = 0xFFFF
MAX_STREAM_ID: Final = 0xFFFFFFFF
DEFAULT_MAX_FRAME_SIZE: Final = 32 * 1024 * 1024

# Response kinds returned by decode_response.
RESP_DATA: Final = 0
RESP_FINAL: Final = 1
RESP_ERROR: Final = 2
RESP_OTHER: Final = 3

Frame = tuple[int, int, int, bytes, bytes]
"""(kind, stream_id, arg, header, body)."""


class FrameError(Exception):
    """The byte stream is not a valid frame sequence (garbage, oversized, truncated)."""


class RequestHeader(msgspec.Struct, array_like=True, frozen=True):
    """Metadata of a REQUEST frame."""

    endpoint: str
    request_id: str
    window: int
    """Frames the server may send ahead of the client's consumption (flow-control window)."""


_encode = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(RequestHeader).decode
_decode_annotated = msgspec.msgpack.Decoder(Annotated[bytes]).decode

# msgpack of Annotated(data=<bin>) is fixmap(1) "data" bin8/bin16/bin32 <bytes>; the data path
# builds it by hand (byte-identical to msgspec's encoding, see tests) to skip a Struct per frame.
_DATA_KEY: Final = b"\x81\xa4data"
_DATA_KEY_LEN: Final = len(_DATA_KEY)
_BIN16: Final = struct.Struct(">BH")
_BIN32: Final = struct.Struct(">BI")
FINAL_BODY: Final = _encode(Annotated.from_complete_final())


_BIN8_HEADS: Final = tuple(_DATA_KEY + bytes((0xC4, n)) for n in range(0x100))
"""The Annotated head of every body shorter than 256 bytes (bin8), by length."""


def _data_head(n: int) -> bytes:
    if n < 0x100:
        return _BIN8_HEADS[n]
    if n < 0x10000:
        return _DATA_KEY + _BIN16.pack(0xC5, n)
    return _DATA_KEY + _BIN32.pack(0xC6, n)


def data_overhead(n: int) -> int:
    """Bytes the Annotated wrapper adds to an ``n``-byte data body."""
    return _DATA_KEY_LEN + (2 if n < 0x100 else 3 if n < 0x10000 else 5)


def data_frame_head(stream_id: int, n: int) -> bytes:
    """Prefix + Annotated head of a RESPONSE data frame; the caller appends the ``n`` body bytes."""
    if n < 0x100:  # a token chunk (the common case): the head from the table, no call
        return PREFIX.pack(MAGIC, RESPONSE, 0, stream_id, 0, _DATA_KEY_LEN + 2 + n) + _BIN8_HEADS[n]
    head = _data_head(n)
    return PREFIX.pack(MAGIC, RESPONSE, 0, stream_id, 0, len(head) + n) + head


def final_frame(stream_id: int) -> bytes:
    return PREFIX.pack(MAGIC, RESPONSE, 0, stream_id, 0, len(FINAL_BODY)) + FINAL_BODY


def error_frame(stream_id: int, kind: str, message: str) -> bytes:
    body = _encode(Annotated.from_error(kind, message))
    return PREFIX.pack(MAGIC, RESPONSE, 0, stream_id, 0, len(body)) + body


def control_frame(kind: int, stream_id: int, arg: int) -> bytes:
    """A header- and body-less CANCEL or CREDIT frame."""
    return PREFIX.pack(MAGIC, kind, arg, stream_id, 0, 0)


def request_frame(stream_id: int, header: RequestHeader, body: bytes) -> tuple[bytes, int]:
    """Prefix + header of a REQUEST frame (the caller appends ``body``) and the message size."""
    raw = _encode(header)
    return PREFIX.pack(MAGIC, REQUEST, 0, stream_id, len(raw), len(body)) + raw, len(raw) + len(
        body
    )


def decode_request_header(raw: bytes) -> RequestHeader:
    try:
        return _decode_header(raw)
    except msgspec.DecodeError as exc:
        raise FrameError(f"bad request header: {exc}") from exc


def decode_response(body: bytes) -> tuple[int, bytes | DynamoError | None]:
    """Classify a RESPONSE body: (RESP_DATA, payload), (RESP_FINAL, None), (RESP_ERROR, error)
    or (RESP_OTHER, None) for annotations the plane does not interpret."""
    size = len(body)
    if size > _DATA_KEY_LEN + 1 and body[:_DATA_KEY_LEN] == _DATA_KEY:
        tag = body[_DATA_KEY_LEN]
        start = n = -1
        if tag == 0xC4:
            start, n = _DATA_KEY_LEN + 2, body[_DATA_KEY_LEN + 1]
        elif tag == 0xC5 and size >= _DATA_KEY_LEN + 3:
            start, n = _DATA_KEY_LEN + 3, _BIN16.unpack_from(body, _DATA_KEY_LEN)[1]
        elif tag == 0xC6 and size >= _DATA_KEY_LEN + 5:
            start, n = _DATA_KEY_LEN + 5, _BIN32.unpack_from(body, _DATA_KEY_LEN)[1]
        if n >= 0 and start + n == size:
            return RESP_DATA, body[start:]
    if body == FINAL_BODY:
        return RESP_FINAL, None
    try:
        item = _decode_annotated(body)
    except msgspec.DecodeError as exc:
        raise FrameError(f"bad response body: {exc}") from exc
    if item.is_complete_final():
        return RESP_FINAL, None
    if item.is_error():
        kind, message = item.error_parts()
        return RESP_ERROR, from_kind(kind, message)
    if item.data is not None:
        return RESP_DATA, item.data
    return RESP_OTHER, None


class FrameDecoder:
    """Incremental frame parser: ``feed(bytes)`` returns the complete frames received so far.

    Raises :class:`FrameError` on a bad magic byte, an unknown kind or a message larger than
    ``max_frame_size`` (as soon as the prefix arrives, before buffering the body). After an error
    the decoder must be discarded with its connection.
    """

    __slots__ = ("_buf", "_need", "_max")

    def __init__(self, max_frame_size: int) -> None:
        if max_frame_size <= 0:
            raise ValueError("max_frame_size must be positive")
        self._buf = bytearray()
        self._need = PREFIX_SIZE  # bytes _buf must hold before parsing is worth retrying
        self._max = max_frame_size

    def pending(self) -> int:
        """Bytes of an incomplete frame held (non-zero at EOF means a truncated frame)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                return []  # a large body still arriving: don't reparse (keeps it O(n))
            data = bytes(buf)
            buf.clear()
        frames: list[Frame] = []
        end = len(data)
        off = 0
        unpack = PREFIX.unpack_from
        limit = self._max
        while end - off >= PREFIX_SIZE:
            magic, kind, arg, sid, hlen, blen = unpack(data, off)
            if magic != MAGIC or kind not in _KINDS:
                raise FrameError(f"bad frame prefix (magic {magic:#x}, kind {kind})")
            size = hlen + blen
            if size > limit:
                raise FrameError(f"frame of {size} bytes exceeds the maximum of {limit}")
            stop = off + PREFIX_SIZE + size
            if stop > end:
                self._need = stop - off
                break
            hstart = off + PREFIX_SIZE
            bstart = hstart + hlen
            frames.append((kind, sid, arg, data[hstart:bstart] if hlen else b"", data[bstart:stop]))
            off = stop
        else:
            self._need = PREFIX_SIZE
        if off < end:
            buf += data[off:] if off else data
        return frames

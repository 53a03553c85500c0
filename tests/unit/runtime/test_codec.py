"""The request-plane framing codec: layout, Annotated bodies, incremental decoding, bad input."""

from __future__ import annotations

import msgspec
import pytest

from dynamo.protocol.annotated import Annotated
from dynamo.runtime import codec
from dynamo.runtime.codec import FrameDecoder, FrameError, RequestHeader
from dynamo.runtime.errors import Cancelled, InvalidArgument, Unknown


def _frames(data: bytes, max_size: int = 1 << 20) -> list[codec.Frame]:
    return FrameDecoder(max_size).feed(data)


def test_prefix_layout() -> None:
    raw = codec.control_frame(codec.CREDIT, 0x01020304, 77)
    assert codec.PREFIX_SIZE == 16
    assert raw == bytes([0xD7, codec.CREDIT, 0, 77, 1, 2, 3, 4]) + bytes(8)
    assert _frames(raw) == [(codec.CREDIT, 0x01020304, 77, b"", b"")]


@pytest.mark.parametrize("n", [0, 1, 255, 256, 65535, 65536, 70000])
def test_data_frame_is_msgpack_annotated(n: int) -> None:
    payload = bytes(i % 251 for i in range(n))
    raw = codec.data_frame_head(9, n) + payload
    [(kind, sid, arg, header, body)] = _frames(raw)
    assert (kind, sid, arg, header) == (codec.RESPONSE, 9, 0, b"")
    # byte-identical to msgspec's own encoding of the Annotated wrapper
    assert body == msgspec.msgpack.encode(Annotated(data=payload))
    assert len(body) == n + codec.data_overhead(n)
    assert codec.decode_response(body) == (codec.RESP_DATA, payload)


def test_final_and_error_frames() -> None:
    final = _frames(codec.final_frame(3))[0][4]
    assert msgspec.msgpack.decode(final, type=Annotated[bytes]).is_complete_final()
    assert codec.decode_response(final) == (codec.RESP_FINAL, None)

    err = _frames(codec.error_frame(3, "InvalidArgument", "bad temperature"))[0][4]
    what, exc = codec.decode_response(err)
    assert what == codec.RESP_ERROR
    assert isinstance(exc, InvalidArgument) and exc.message == "bad temperature"
    what, exc = codec.decode_response(msgspec.msgpack.encode(Annotated.from_error("Nope", "x")))
    assert isinstance(exc, Unknown)
    _, exc = codec.decode_response(msgspec.msgpack.encode(Annotated.from_error("Cancelled", "")))
    assert isinstance(exc, Cancelled)


def test_decode_response_general_path() -> None:
    # Other encoders may add fields; the slow path still finds the data.
    body = msgspec.msgpack.encode(Annotated(data=b"tok", id="7"))
    assert codec.decode_response(body) == (codec.RESP_DATA, b"tok")
    note = msgspec.msgpack.encode(Annotated.from_annotation("request_id", '"r1"'))
    assert codec.decode_response(note) == (codec.RESP_OTHER, None)
    # a data head whose length disagrees with the body is not taken by the fast path
    with pytest.raises(FrameError):
        codec.decode_response(b"\x81\xa4data\xc4\x05ab")
    with pytest.raises(FrameError):
        codec.decode_response(b"\xff\x00garbage")


def test_request_frame_round_trip() -> None:
    header = RequestHeader("ns.comp.generate", "req-1", 64)
    head, size = codec.request_frame(5, header, b"payload")
    [(kind, sid, arg, raw_header, body)] = _frames(head + b"payload")
    assert (kind, sid, arg, body) == (codec.REQUEST, 5, 0, b"payload")
    assert size == len(raw_header) + len(body)
    assert codec.decode_request_header(raw_header) == header
    with pytest.raises(FrameError):
        codec.decode_request_header(b"\x93\x01")


def test_incremental_feeding_byte_by_byte() -> None:
    stream = b"".join(
        [
            codec.request_frame(1, RequestHeader("a.b.c", "r", 8), b"xyz")[0] + b"xyz",
            codec.control_frame(codec.CANCEL, 1, codec.CANCEL_STOP),
            codec.data_frame_head(1, 300) + b"q" * 300,
            codec.final_frame(1),
        ]
    )
    decoder = FrameDecoder(1 << 20)
    frames: list[codec.Frame] = []
    for i in range(len(stream)):
        frames += decoder.feed(stream[i : i + 1])
    assert decoder.pending() == 0
    assert [f[0] for f in frames] == [codec.REQUEST, codec.CANCEL, codec.RESPONSE, codec.RESPONSE]
    assert frames[0][4] == b"xyz"
    assert codec.decode_response(frames[2][4]) == (codec.RESP_DATA, b"q" * 300)
    assert frames == _frames(stream)


def test_large_body_in_chunks() -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB
    raw = codec.data_frame_head(2, len(payload)) + payload
    decoder = FrameDecoder(4 << 20)
    frames: list[codec.Frame] = []
    for start in range(0, len(raw), 65536):
        frames += decoder.feed(raw[start : start + 65536])
    assert len(frames) == 1 and codec.decode_response(frames[0][4])[1] == payload


def test_truncated_frame_is_pending() -> None:
    raw = codec.data_frame_head(2, 100) + b"z" * 40
    decoder = FrameDecoder(1 << 20)
    assert decoder.feed(raw) == []
    assert decoder.pending() == len(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # wrong magic
        bytes([0xD7, 9]) + bytes(14),  # unknown kind
    ],
)
def test_garbage_is_rejected(raw: bytes) -> None:
    with pytest.raises(FrameError, match="bad frame prefix"):
        FrameDecoder(1 << 20).feed(raw)


def test_oversized_frame_is_rejected_from_its_prefix() -> None:
    prefix = codec.PREFIX.pack(codec.MAGIC, codec.RESPONSE, 0, 1, 0, 5000)
    with pytest.raises(FrameError, match="exceeds the maximum of 4096"):
        FrameDecoder(4096).feed(prefix)  # no body needed to refuse it
    assert FrameDecoder(5000).feed(prefix) == []


def test_max_frame_size_must_be_positive() -> None:
    assert codec.DEFAULT_MAX_FRAME_SIZE == 32 * 1024 * 1024
    with pytest.raises(ValueError):
        FrameDecoder(0)

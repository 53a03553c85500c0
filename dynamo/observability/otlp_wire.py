"""OTLP's protobuf wire format for :class:`~dynamo.observability.recording.RecordedSpan` s
(``ExportTraceServiceRequest``), written by hand for speed: ``encode_span`` and the batch's
``Encoder``. The transports and the batching thread are in ``otlp.py``."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from dynamo.observability.recording import UNSET_STATUS, RecordedSpan

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack

# -- protobuf wire format ------------------------------------------------------------------
# Written by hand for speed (every call here runs per span): single-byte tags and lengths come
# from tables, and the KeyValue of a repeated (key, string or bool value) pair is encoded once.
_BYTE = [bytes((i,)) for i in range(256)]


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64: two's complement, ten bytes
    if value < 0x80:
        return _BYTE[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2) whose encoded tag is ``tag``."""
    n = len(payload)
    return tag + (_BYTE[n] if n < 0x80 else _varint(n)) + payload


def _tag(number: int) -> bytes:
    return _varint(number << 3 | 2)


def _field(number: int, payload: bytes) -> bytes:
    return _ld(_tag(number), payload)


_T1, _T2, _T3, _T4, _T5 = (_tag(i) for i in range(1, 6))
_T9, _T11, _T13, _T15 = _tag(9), _tag(11), _tag(13), _tag(15)


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` message: string 1, bool 2, int 3, double 4, array 5, bytes 7."""
    if isinstance(value, str):
        return _ld(_T1, value.encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    if isinstance(value, bytes):
        return _field(7, value)
    if isinstance(value, (list, tuple)):
        return _ld(_T5, b"".join(_ld(_T1, _any_value(v)) for v in value))
    return _ld(_T1, str(value).encode())


_MAX_CACHED = 8192
_key_cache: dict[str, bytes] = {}
_pair_cache: dict[tuple[bytes, str, str | bool], bytes] = {}
_int_cache: dict[tuple[bytes, str, int], bytes] = {}
_float_cache: dict[tuple[bytes, str], bytes] = {}


def _key_value(key: str, value: Any) -> bytes:
    """A ``KeyValue`` message's body."""
    encoded_key = _key_cache.get(key)
    if encoded_key is None:
        encoded_key = _ld(_T1, key.encode())
        if len(_key_cache) < _MAX_CACHED:
            _key_cache[key] = encoded_key
    return encoded_key + _ld(_T2, _any_value(value))


def _attributes(tag: bytes, attributes: Mapping[str, Any]) -> bytes:
    """``repeated KeyValue`` as the field whose tag is ``tag``. Per attribute one dict
    look-up in the common cases: a (key, string or bool value) pair and a (key, small int)
    pair are encoded once, field and all; a float's field is a cached prefix and its 8
    bytes."""
    out = []
    for key, value in attributes.items():
        kind = type(value)
        if kind is str or kind is bool:  # labels repeat
            field = _pair_cache.get((tag, key, value))
            if field is None:
                keep = kind is bool or len(value) <= 64
                field = _cached_field(tag, key, value, _pair_cache, keep)
            out.append(field)
        elif kind is float:
            prefix = _float_cache.get((tag, key))
            if prefix is None:
                # tag, length (key field + field 2 of 9 bytes), key field, AnyValue's double tag
                body = _key_value(key, 0.0)
                prefix = tag + _varint(len(body)) + body[:-8]
                if len(_float_cache) < _MAX_CACHED:
                    _float_cache[(tag, key)] = prefix
            out.append(prefix)
            out.append(_pack_double(value))
        elif kind is int:  # counts repeat
            field = _int_cache.get((tag, key, value))
            if field is None:
                field = _cached_field(tag, key, value, _int_cache, 0 <= value < 1 << 16)
            out.append(field)
        else:
            out.append(_ld(tag, _key_value(key, value)))
    return b"".join(out)


def _cached_field(tag: bytes, key: str, value: Any, cache: dict[Any, bytes], keep: bool) -> bytes:
    field = _ld(tag, _key_value(key, value))
    if keep and len(cache) < _MAX_CACHED:
        cache[(tag, key, value)] = field
    return field


def _link(link: Link) -> bytes:
    ctx = link.context
    out = _ld(_T1, ctx.trace_id.to_bytes(16, "big")) + _ld(_T2, ctx.span_id.to_bytes(8, "big"))
    if ctx.trace_state:
        out += _ld(_T3, ctx.trace_state.to_header().encode())
    if link.attributes:
        out += _attributes(_T4, link.attributes)
    return out + b"\x35" + _pack_fixed32(int(ctx.trace_flags))


# OTLP counts from 0=UNSPECIFIED; keyed by the member's id (an Enum member's hash is a Python
# call)
_KIND = {id(kind): b"\x30" + _BYTE[kind.value + 1] for kind in SpanKind}
_TIMES = struct.Struct("<cQcQ").pack  # 7: start, 8: end (fixed64 each)
_FLAGS = [b"\x85\x01" + _pack_fixed32(flags) for flags in range(1 << 10)]  # 16: flags
_MAX_NAMES = 1024
_names: dict[str, bytes] = {}


def encode_span(span: RecordedSpan) -> bytes:
    """One ``Span`` message (opentelemetry/proto/trace/v1/trace.proto)."""
    ctx = span.context  # the tuple (trace_id, span_id, is_remote, flags, state, valid)
    parent = span.parent
    out = [
        b"\x0a\x10",  # 1: trace_id, 16 bytes
        ctx[0].to_bytes(16, "big"),
        b"\x12\x08",  # 2: span_id, 8 bytes
        ctx[1].to_bytes(8, "big"),
    ]
    state = ctx[4]
    if state is not DEFAULT_TRACE_STATE and state:  # (a TraceState's len() is a Python call)
        out.append(_ld(_T3, state.to_header().encode()))
    if parent is not None:
        out.append(b"\x22\x08")  # 4: parent_span_id
        out.append(parent[1].to_bytes(8, "big"))
    name = _names.get(span.name)
    if name is None:
        name = _ld(_T5, span.name.encode())
        if len(_names) < _MAX_NAMES:
            _names[span.name] = name
    out.append(name)
    out.append(_KIND[id(span.kind)])
    out.append(_TIMES(b"\x39", span.start_ns, b"\x41", span.end_ns))
    if span.attributes:
        out.append(_attributes(_T9, span.attributes))
    for event in span.events:
        body = b"\x09" + _pack_fixed64(event.time_ns) + _ld(_T2, event.name.encode())
        out.append(_ld(_T11, body + _attributes(_T3, event.attributes)))
    for link in span.links:
        out.append(_ld(_T13, _link(link)))
    status = span.status
    if status is not UNSET_STATUS:
        code = status.status_code.value
        if code:
            body = _ld(_T2, status.description.encode()) if status.description else b""
            out.append(_ld(_T15, body + b"\x18" + _BYTE[code]))
    # 16: flags, the W3C trace flags plus "whether the parent is remote" known (bit 8) and
    # true (bit 9)
    flags = ctx[3] | 0x100
    if parent is not None and parent[2]:
        flags |= 0x200
    out.append(_FLAGS[flags])
    return b"".join(out)


class Encoder:
    """``ExportTraceServiceRequest`` bytes for a batch of one process's spans."""

    def __init__(self, resource: Mapping[str, Any], scope: str = "dynamo") -> None:
        self._resource = _ld(_T1, _attributes(_T1, resource))
        self._scope = _ld(_T1, _ld(_T1, scope.encode()))

    def encode(self, spans: Iterable[RecordedSpan]) -> bytes:
        scope_spans = self._scope + b"".join([_ld(_T2, encode_span(s)) for s in spans])
        return _ld(_T1, self._resource + _ld(_T2, scope_spans))

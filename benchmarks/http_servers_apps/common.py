"""Shared workload for the HTTP server benchmark: a chat.completion.chunk SSE stream."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import msgspec

N_EVENTS = int(os.environ.get("BENCH_EVENTS", "64"))
TOKENS = [" the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog"]
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
]


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class Choice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class Chunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None


class ChatRequest(msgspec.Struct):
    model: str
    messages: list[dict[str, str]]
    stream: bool = False
    max_tokens: int | None = None


_DECODER = msgspec.json.Decoder(ChatRequest)
_ENCODER = msgspec.json.Encoder()


def parse_request(body: bytes) -> ChatRequest:
    """Decode the request body (the same work every candidate does)."""
    return _DECODER.decode(body)


def make_chunk(req_id: str, created: int, model: str, i: int) -> Chunk:
    """The i-th chunk of a stream: role in the first delta, finish_reason in the last."""
    last = i == N_EVENTS - 1
    delta = Delta(role="assistant", content="") if i == 0 else Delta(content=TOKENS[i % 8])
    return Chunk(
        id=req_id,
        created=created,
        model=model,
        choices=[Choice(index=0, delta=delta, finish_reason="stop" if last else None)],
    )


def sse_events(req: ChatRequest) -> Iterator[bytes]:
    """The N_EVENTS `data: {json}` events followed by `data: [DONE]`, each one write."""
    req_id = "chatcmpl-" + os.urandom(12).hex()
    created = int(time.time())
    for i in range(N_EVENTS):
        yield b"data: " + _ENCODER.encode(make_chunk(req_id, created, req.model, i)) + b"\n\n"
    yield DONE


def set_nodelay(sock: socket.socket | None, on: bool = True) -> None:
    """Set TCP_NODELAY on an accepted TCP socket (no-op for non-TCP transports)."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1 if on else 0)

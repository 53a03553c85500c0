"""The tokenizer process: ``python -m dynamo.preprocess.encode_child FD``, started by
``encode_process.py`` with one end of a socket pair as ``FD``. It answers one
:class:`~dynamo.preprocess.encode_wire.EncodeBatch` at a time, reading the whole batch before it
writes the reply, with the same :class:`~dynamo.preprocess.tokenizer.Tokenizer` code as
in-process encoding (so the same ids). It exits when the parent closes its end (or dies: the socket
then reads end-of-file), and ignores SIGINT (a Ctrl-C reaches the whole process group; the
frontend decides when it stops). Unlike the tokenizer thread it runs under the ordinary policy
(not ``SCHED_BATCH``): it holds no lock the event loop needs, so running at once when a batch
arrives only shortens the batch's round trip (measured: docs/performance.md, helper ``tokp``).
"""

from __future__ import annotations

import signal
import socket
import sys

import msgspec

from dynamo.preprocess.encode_wire import (
    HEADER,
    EncodeBatch,
    EncodeGroup,
    EncodeReply,
    GroupIds,
    frame,
    frame_length,
)
from dynamo.preprocess.tokenizer import Tokenizer


def encode_group(tokenizer: Tokenizer | None, group: EncodeGroup) -> GroupIds:
    """The ids of ``group``'s texts; a text the tokenizer refuses (or every text, without a
    tokenizer) is listed as failed, and does not fail the others."""
    texts = group.texts
    if tokenizer is None:
        return GroupIds([[] for _ in texts], list(range(len(texts))))
    special = group.add_special_tokens
    try:
        return GroupIds(tokenizer.encode_batch(texts, add_special_tokens=special), [])
    except Exception:  # one refused text: encode them one by one
        ids: list[list[int]] = []
        failed: list[int] = []
        for index, text in enumerate(texts):
            try:
                ids.append(tokenizer.encode(text, add_special_tokens=special))
            except Exception:
                ids.append([])
                failed.append(index)
        return GroupIds(ids, failed)


def _read_exactly(sock: socket.socket, size: int) -> bytearray | None:
    """``size`` bytes from ``sock``, or None at end-of-file."""
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], min(size - got, 1 << 20))
        if n == 0:
            return None
        got += n
    return data


def serve(sock: socket.socket) -> None:
    """Answer batches until the parent closes its end."""
    decoder = msgspec.msgpack.Decoder(EncodeBatch)
    encoder = msgspec.msgpack.Encoder()
    loaded: dict[int, Tokenizer] = {}
    sock.sendall(frame(b""))  # ready: the parent times replies from now on
    while True:
        header = _read_exactly(sock, HEADER.size)
        body = None if header is None else _read_exactly(sock, frame_length(header))
        if body is None:
            return
        batch = decoder.decode(body)
        for key in batch.drops:
            loaded.pop(key, None)
        for load in batch.loads:
            try:
                loaded[load.key] = Tokenizer.from_str(load.serialized)
            except Exception as exc:  # its groups fail: the parent encodes them itself
                print(f"tokenizer process: tokenizer {load.key} not loaded: {exc}", file=sys.stderr)
                loaded.pop(load.key, None)
        reply = EncodeReply([encode_group(loaded.get(g.key), g) for g in batch.groups])
        sock.sendall(frame(encoder.encode(reply)))


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with socket.socket(fileno=int(argv[1])) as sock:
        sock.setblocking(True)
        try:
            serve(sock)
        except (ConnectionError, BrokenPipeError):  # the parent went away mid-reply
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

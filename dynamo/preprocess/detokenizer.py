"""Incremental detokenization with stop conditions: the frontend's per-token output path.

Turns a request's generated token ids into text deltas that are safe to send: never half a UTF-8
character, never any part of a stop string, and nothing after a stop token, EOS or stop string.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import NamedTuple, cast

from dynamo.preprocess.stop_strings import NO_STOPS, StopStrings
from dynamo.preprocess.tokenizer import Tokenizer
from dynamo.protocol.output import FinishReason


class DeltaResult(NamedTuple):
    """What one :meth:`IncrementalDetokenizer.add` produced.

    ``text`` may be empty (a partial character or a possible stop-string prefix is held back).
    ``finished`` is set once, when a stop token, EOS or stop string ended the output.
    """

    text: str
    finished: FinishReason | None = None


# DeltaResult(...) runs a Python-level __new__; this is the same tuple at half the cost.
_tuple_new = tuple.__new__


class _ByteLevelDecoder:
    """Byte-level BPE: token -> bytes (table lookup) -> UTF-8, holding an incomplete multi-byte
    sequence (``partial``) until its last byte arrives. Bytes that can never form a character
    become U+FFFD at once, exactly as ``Tokenizer.decode`` does.

    Most tokens are complete UTF-8 on their own: ``lookup`` gives their text directly.
    """

    __slots__ = ("table", "lookup", "partial")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self.table = tokenizer.byte_table(skip_special_tokens)
        self.lookup = tokenizer.token_texts(skip_special_tokens).get
        self.partial = b""

    def step(self, token_id: int) -> str:
        if not self.partial:
            text = self.lookup(token_id)
            if text is not None:
                return text
        if not 0 <= token_id < len(self.table):
            return ""  # unknown ids decode to nothing, as in Tokenizer.decode
        data = self.partial + self.table[token_id]
        text, consumed = codecs.utf_8_decode(data, "replace", False)
        self.partial = data[consumed:]
        return text

    def chunk(self, token_ids: Sequence[int]) -> str | None:
        """The text of ``token_ids`` at once, as :meth:`step` on each would give it joined
        (UTF-8 decoding is the same whatever the split of its input); None (nothing consumed)
        when an id is outside the table: :meth:`step` then decodes it to nothing."""
        if not token_ids:
            return ""
        if min(token_ids) < 0 or max(token_ids) >= len(self.table):
            return None
        data = self.partial + b"".join(map(self.table.__getitem__, token_ids))
        text, consumed = codecs.utf_8_decode(data, "replace", False)
        self.partial = data[consumed:]
        return text

    def final(self) -> str:
        if not self.partial:
            return ""
        text, _ = codecs.utf_8_decode(self.partial, "replace", True)
        self.partial = b""
        return text


class _WindowDecoder:
    """Any other tokenizer (e.g. SentencePiece with byte fallback): the prefix/read-offset method
    of Hugging Face TGI and vLLM. Text is decoded over a small window that starts one emitted token
    back, so decoders that depend on neighbours (leading-space stripping) stay correct, and a
    delta ending in U+FFFD (an incomplete character) is held until a later token completes it."""

    __slots__ = ("_tokenizer", "_skip", "_ids", "_read")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # window: ids[:read] were emitted (prefix), ids[read:] are not
        self._read = 0

    def step(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(ids[: self._read], self._skip) if self._read else ""
        new_text = decode(ids, self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        del ids[: self._read]  # the next window starts at the tokens just emitted
        self._read = len(ids)
        return new_text[len(prefix_text) :]

    def final(self) -> str:
        ids = self._ids
        if len(ids) == self._read:
            return ""
        prefix_text = self._tokenizer.decode(ids[: self._read], self._skip) if self._read else ""
        text = self._tokenizer.decode(ids, self._skip)
        self._read = len(ids)
        return text[len(prefix_text) :]


class IncrementalDetokenizer:
    """Streams one choice's output text while applying stop conditions.

    Stop rules (vLLM semantics):

    * a token in ``stop_token_ids``, or in ``eos_token_ids`` unless ``ignore_eos``, ends the output
      with ``stop``; the token itself adds no text. The first ``min_tokens`` tokens are never
      stops (they decode as ordinary tokens);
    * a stop string ends the output at its start: neither it nor anything after it is emitted. The
      first stop string *completed* wins (earliest end, then earliest start), so the result does
      not depend on how tokens are chunked. Only stop strings completed by the ``min_tokens``-th
      token or later count;
    * text that could still become the start of a stop string is held back (only the minimal such
      suffix), as is an incomplete UTF-8 character.

    Usage per engine chunk: ``res = detok.add(chunk.token_ids)``; send ``res.text``; if
    ``res.finished`` the choice is over (stop the request). If the engine's stream ends first
    (``length``, or the engine's own stop), call :meth:`flush` once and send its text too.
    Not thread-safe; one instance per choice.
    """

    __slots__ = (
        "_decoder",
        "_byte_level",
        "_stop_ids",
        "_stops",
        "_has_stops",
        "_min_tokens",
        "_num_tokens",
        "_ignore_before",
        "_pending",
        "_emitted",
        "_finished",
        "_closed",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        if min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        self._decoder: _ByteLevelDecoder | _WindowDecoder
        self._byte_level: _ByteLevelDecoder | None = None
        if tokenizer.is_byte_level:
            self._byte_level = _ByteLevelDecoder(tokenizer, skip_special_tokens)
            self._decoder = self._byte_level
        else:
            self._decoder = _WindowDecoder(tokenizer, skip_special_tokens)
        stop_ids = set(stop_token_ids)
        if not ignore_eos:
            stop_ids.update(eos_token_ids)
        self._stop_ids = frozenset(stop_ids)
        self._stops = StopStrings(stop) if stop else NO_STOPS  # most requests have none
        self._has_stops = bool(self._stops)  # a plain attribute: checked on every add()
        self._min_tokens = min_tokens
        self._num_tokens = 0
        # Absolute text position; stop strings must end after it. None: min_tokens not reached.
        self._ignore_before: int | None = 0 if min_tokens <= 1 else None
        self._pending = ""  # decoded, not yet emitted (a possible stop-string prefix)
        self._emitted = 0  # number of characters emitted so far
        self._finished: FinishReason | None = None
        self._closed = False

    @property
    def num_tokens(self) -> int:
        """Generated tokens consumed: up to and including the token that ended the output."""
        return self._num_tokens

    @property
    def finished(self) -> FinishReason | None:
        """``stop`` once a stop condition ended the output, else None."""
        return self._finished

    def add(self, token_ids: Sequence[int]) -> DeltaResult:
        """Consume newly generated tokens; return the text that is now safe to emit.

        After a result with ``finished`` (or after :meth:`flush`), further calls return an empty
        result with the same ``finished`` and do nothing.
        """
        if self._closed:
            return DeltaResult("", self._finished)
        byte_level = self._byte_level
        if (
            byte_level is not None
            and self._ignore_before is not None
            and self._stop_ids.isdisjoint(token_ids)
        ):
            # Fast path, almost every chunk: byte-level tokenizer, no stop token in the chunk,
            # min_tokens reached.
            if not self._has_stops:  # then nothing is ever pending: the chunk's text at once
                text = byte_level.chunk(token_ids)
                if text is not None:
                    self._num_tokens += len(token_ids)
                    self._emitted += len(text)
                    return _tuple_new(DeltaResult, (text, None))
            else:  # one piece per token, for the stop strings' token count
                if byte_level.partial:
                    pieces = list(map(byte_level.step, token_ids))
                else:
                    # Tokens complete UTF-8 on their own are a table lookup; from the first
                    # one that is not (a byte of a multi-byte character), the decoder's step.
                    found = list(map(byte_level.lookup, token_ids))
                    if None in found:
                        first = found.index(None)
                        del found[first:]
                        found += map(byte_level.step, token_ids[first:])
                    pieces = cast("list[str]", found)
                num_before = self._num_tokens
                self._num_tokens = num_before + len(pieces)
                return self._emit(pieces, num_before)
        return self._add_each(token_ids)

    def _add_each(self, token_ids: Sequence[int]) -> DeltaResult:
        """The general path: token by token, for stop tokens, min_tokens and unknown ids."""
        step = self._decoder.step
        stop_ids = self._stop_ids
        min_tokens = self._min_tokens
        count = num_before = self._num_tokens
        pieces: list[str] = []
        for token_id in token_ids:
            count += 1
            if token_id in stop_ids and count > min_tokens:
                self._num_tokens = count
                pieces.append(self._decoder.final())
                return self._emit(pieces, num_before, stop_token=True)
            if count == min_tokens and self._ignore_before is None:
                self._ignore_before = self._emitted + len(self._pending) + sum(map(len, pieces))
            pieces.append(step(token_id))
        self._num_tokens = count
        return self._emit(pieces, num_before)

    def _emit(self, pieces: list[str], num_before: int, stop_token: bool = False) -> DeltaResult:
        """Apply stop strings to the new text (``pieces``: one per token) and hold back what
        could still start one. ``stop_token``: a stop token ended the output after ``pieces``."""
        buf = self._pending + "".join(pieces)
        if self._has_stops and self._ignore_before is not None and buf:
            # buf starts at self._emitted; stop strings must end after ignore_before.
            match = self._stops.find(buf, self._ignore_before - self._emitted)
            if match is not None:
                start, end = match
                self._num_tokens = num_before + _token_index(pieces, end - len(self._pending))
                return self._finish(buf[:start])
        if stop_token:
            return self._finish(buf)
        if self._has_stops:
            hold = self._stops.held_suffix_start(buf)
            self._pending = buf[hold:]
            buf = buf[:hold]
        self._emitted += len(buf)
        return _tuple_new(DeltaResult, (buf, None))

    def flush(self) -> DeltaResult:
        """End of stream without a stop condition: emit everything held back.

        Includes an incomplete trailing character (as U+FFFD, like ``Tokenizer.decode``) and a
        partial stop-string prefix. Idempotent.
        """
        if self._closed:
            return DeltaResult("", self._finished)
        self._closed = True
        buf = self._pending + self._decoder.final()
        self._pending = ""
        if self._has_stops and self._ignore_before is not None and buf:
            # buf starts at self._emitted; stop strings must end after ignore_before.
            match = self._stops.find(buf, self._ignore_before - self._emitted)
            if match is not None:
                return self._finish(buf[: match[0]])
        self._emitted += len(buf)
        return DeltaResult(buf)

    def _finish(self, text: str) -> DeltaResult:
        self._closed = True
        self._finished = FinishReason.STOP
        self._pending = ""
        self._emitted += len(text)
        return DeltaResult(text, FinishReason.STOP)


def _token_index(pieces: list[str], end: int) -> int:
    """How many of ``pieces`` (one per token) it takes to reach text position ``end``."""
    if end <= 0:
        return 0
    total = 0
    for index, piece in enumerate(pieces):
        total += len(piece)
        if total >= end:
            return min(index + 1, len(pieces))
    return len(pieces)

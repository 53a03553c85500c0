"""``Tokenizer``: a thin, fast wrapper over a Hugging Face ``tokenizers.Tokenizer``.

It owns encoding (the frontend's hot path), batch decoding, special-token bookkeeping, and the
per-token byte table that the incremental detokenizer uses for byte-level BPE tokenizers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"


def serial_tokenization() -> None:
    """Encode every batch on the calling thread rather than on the library's thread pool, for the
    rest of this process, unless the environment already says otherwise (``TOKENIZERS_PARALLELISM``
    is the library's own switch, read at every call). Entry points of a frontend call it first.

    Why: the pool (rayon) takes even a one-prompt batch to one of its threads and back, and its
    idle threads spin with ``sched_yield`` before they sleep. The frontend's tokenizer thread
    already runs beside the event loop (``encode_thread.py``), with one core's worth of prompts
    (~5,000 a second) to spare; the pool only added CPU: at c=64 on the 2-core VM ~11 syscalls
    a request (15.5k ``sched_yield`` and 7k ``futex`` calls per 2,000 requests) and ~5 % of the
    frontend's CPU. Same token ids either way."""
    os.environ.setdefault(PARALLELISM_ENV, "false")


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-char map as ``char -> byte`` (ByteLevel alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_values = printable[:]
    chars = printable[:]
    shift = 0
    for byte in range(256):
        if byte not in printable:
            byte_values.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(char): byte for byte, char in zip(byte_values, chars, strict=True)}


def _is_byte_level_decoder(decoder: Any) -> bool:
    """True when decoding is exactly "concatenate the token bytes, then UTF-8 (lossy)"."""
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        parts = decoder.get("decoders") or []
        return len(parts) == 1 and _is_byte_level_decoder(parts[0])
    return False


def _max_token_chars(raw: tokenizers.Tokenizer, model: Any) -> int | None:
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    if model.get("fuse_unk") and not model.get("byte_fallback"):
        return None  # runs of unknown characters fuse into one token
    vocab = raw.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=1) or 1


class Tokenizer:
    """Encodes and decodes text with a model's ``tokenizer.json``.

    Immutable after construction and safe to share between concurrent requests. ``encode`` never
    adds special tokens unless asked (chat templates already contain them).
    """

    __slots__ = (
        "_raw",
        "_vocab_size",
        "_special_ids",
        "_byte_level",
        "_byte_tables",
        "_token_texts",
        "_max_token_chars",
        "_serialized",
        "__weakref__",
    )

    def __init__(self, raw: tokenizers.Tokenizer) -> None:
        self._raw = raw
        # Padding/truncation would silently change what we send to engines.
        raw.no_padding()
        raw.no_truncation()
        self._vocab_size: int = raw.get_vocab_size(with_added_tokens=True)
        added = raw.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._serialized: str = raw.to_str()
        spec = json.loads(self._serialized)
        self._byte_level = _is_byte_level_decoder(spec.get("decoder"))
        self._max_token_chars = _max_token_chars(raw, spec.get("model"))
        self._byte_tables: dict[bool, tuple[bytes, ...]] = {}
        self._token_texts: dict[bool, dict[int, str]] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a ``tokenizer.json``."""
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @classmethod
    def from_str(cls, text: str) -> Tokenizer:
        """Load the JSON text of a ``tokenizer.json``."""
        return cls(tokenizers.Tokenizer.from_str(text))

    @property
    def raw(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (do not mutate it)."""
        return self._raw

    @property
    def serialized(self) -> str:
        """The ``tokenizer.json`` text of this tokenizer (``from_str`` rebuilds it): what the
        tokenizer process loads (``encode_process.py``). Kept from construction, which needs it
        anyway, so shipping it costs no serialization on the event loop."""
        return self._serialized

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (skipped when ``skip_special_tokens``)."""
        return self._special_ids

    @property
    def is_byte_level(self) -> bool:
        """Whether the decoder is byte-level BPE (GPT-2, Llama 3, Qwen, ...)."""
        return self._byte_level

    @property
    def max_token_chars(self) -> int | None:
        """The most characters of input one token can cover, when the model bounds it (BPE
        without fused unknowns: every token is a vocabulary entry, the longest of which bounds
        it), else None (e.g. WordPiece, where one ``[UNK]`` covers a whole word). So a text of
        ``n`` characters has at least ``ceil(n / max_token_chars)`` tokens."""
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (e.g. adds BOS)."""
        # encode_batch_fast skips offset tracking: about 30 % cheaper than encode() here.
        encoding = self._raw.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        ids: list[int] = encoding.ids
        return ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        """Token ids of several texts (one call into Rust)."""
        encodings = self._raw.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (incomplete UTF-8 at the end decodes to U+FFFD)."""
        text: str = self._raw.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (vocabulary form, e.g. ``"Ġthe"``), or None."""
        token_id: int | None = self._raw.token_to_id(token)
        return token_id

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id (vocabulary form), or None for an unknown id."""
        token: str | None = self._raw.id_to_token(token_id)
        return token

    def byte_table(self, skip_special_tokens: bool = True) -> tuple[bytes, ...]:
        """For byte-level tokenizers: the UTF-8 bytes each token id decodes to (index = id).

        ``decode(ids)`` equals ``b"".join(table[i] for i in ids).decode("utf-8", "replace")``.
        Special tokens map to ``b""`` when ``skip_special_tokens``. Built once per flag, then
        cached. Raises ValueError when the tokenizer is not byte-level.
        """
        table = self._byte_tables.get(skip_special_tokens)
        if table is None:
            table = self._build_byte_table(skip_special_tokens)
            self._byte_tables[skip_special_tokens] = table
        return table

    def token_texts(self, skip_special_tokens: bool = True) -> dict[int, str]:
        """For byte-level tokenizers: the text of every token whose bytes are complete UTF-8 on
        their own (most of the vocabulary; not the pieces of split multi-byte characters).
        Built once per flag, then cached."""
        texts = self._token_texts.get(skip_special_tokens)
        if texts is None:
            texts = {}
            for token_id, data in enumerate(self.byte_table(skip_special_tokens)):
                try:
                    texts[token_id] = data.decode("utf-8")
                except UnicodeDecodeError:
                    continue
            self._token_texts[skip_special_tokens] = texts
        return texts

    def _build_byte_table(self, skip_special_tokens: bool) -> tuple[bytes, ...]:
        if not self._byte_level:
            raise ValueError("byte_table() needs a byte-level tokenizer")
        char_to_byte = _bytes_to_unicode()
        table: list[bytes] = []
        for token_id in range(self._vocab_size):
            token = self._raw.id_to_token(token_id)
            if token is None or (skip_special_tokens and token_id in self._special_ids):
                table.append(b"")
                continue
            # Same rule as the Rust ByteLevel decoder: map every char through the alphabet, or,
            # if any char is outside it (e.g. an added token with a space), use its raw UTF-8.
            try:
                table.append(bytes(char_to_byte[char] for char in token))
            except KeyError:
                table.append(token.encode("utf-8"))
        return tuple(table)

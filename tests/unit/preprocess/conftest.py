"""Shared fixtures: the demo model, and a SentencePiece-style tokenizer (byte fallback, Metaspace)
that exercises the detokenizer's generic (non byte-level) path."""

from __future__ import annotations

import string

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from dynamo.preprocess import ModelDir, Tokenizer, demo_model_path, load_model_dir


@pytest.fixture(scope="session")
def demo_model() -> ModelDir:
    return load_model_dir(demo_model_path())


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model: ModelDir) -> Tokenizer:
    return demo_model.tokenizer


def build_sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-like tokenizer: Unigram pieces, byte fallback for anything else, and the
    Llama-2 decoder (▁ -> space, byte fallback, fuse, strip one leading space)."""
    pieces: list[tuple[str, float]] = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{byte:02X}>", 0.0) for byte in range(256)]
    pieces += [(char, -5.0) for char in string.ascii_letters + string.digits + ".,!?'-:;()"]
    pieces.append(("▁", -4.0))
    words = "the quick brown fox jumps over lazy dog hello world stop end model token café 你好"
    pieces += [("▁" + word, -2.0) for word in words.split()]
    pieces += [(word, -3.0) for word in ("ing", "ed", "er", "th", "he", "ll", "wor")]
    raw = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    raw.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(raw)


@pytest.fixture(scope="session")
def sp_tokenizer() -> Tokenizer:
    return build_sentencepiece_tokenizer()

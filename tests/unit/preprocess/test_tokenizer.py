"""Tokenizer wrapper: encoding matches the raw tokenizer, decoding, specials, the byte table."""

from __future__ import annotations

import codecs
import os
import random

import pytest

from dynamo.preprocess import Tokenizer, demo_model_path
from dynamo.preprocess.tokenizer import PARALLELISM_ENV, serial_tokenization

TEXTS = [
    "Hello, world!",
    "The router sends each request to the worker with the longest cached prefix.",
    "Café crème, naïve résumé, Straße, 你好世界, 日本語, 한국어, emoji 🦄🚀👋🏽 and ꙮ",
    'def f(x):\n    return {"a": [1, 2, 3]}\n',
    "",
    "   leading and trailing spaces   ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_raw_tokenizer_and_round_trips(demo_tokenizer: Tokenizer, text: str) -> None:
    ids = demo_tokenizer.encode(text)
    assert ids == demo_tokenizer.raw.encode(text, add_special_tokens=False).ids
    assert demo_tokenizer.decode(ids) == text


def test_add_special_tokens_prepends_bos(demo_tokenizer: Tokenizer) -> None:
    bos = demo_tokenizer.token_to_id("<|begin_of_text|>")
    plain = demo_tokenizer.encode("Hi there")
    assert demo_tokenizer.encode("Hi there", add_special_tokens=True) == [bos, *plain]


def test_special_tokens_in_text_are_single_tokens(demo_tokenizer: Tokenizer) -> None:
    eot = demo_tokenizer.token_to_id("<|eot_id|>")
    assert eot is not None and eot in demo_tokenizer.special_token_ids
    ids = demo_tokenizer.encode("a<|eot_id|>b")
    assert eot in ids
    assert demo_tokenizer.decode(ids) == "ab"
    assert demo_tokenizer.decode(ids, skip_special_tokens=False) == "a<|eot_id|>b"


def test_encode_batch(demo_tokenizer: Tokenizer) -> None:
    assert demo_tokenizer.encode_batch(TEXTS) == [demo_tokenizer.encode(t) for t in TEXTS]


def test_serial_tokenization_keeps_an_explicit_setting_and_the_ids(
    demo_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    chat = "<|start_header_id|>user<|end_header_id|>\n\n" + " ".join(TEXTS) + "<|eot_id|>"
    texts = [*TEXTS, chat] * 3
    monkeypatch.setenv(PARALLELISM_ENV, "true")
    serial_tokenization()
    assert demo_tokenizer.encode_batch(texts) == [demo_tokenizer.encode(t) for t in texts]
    pooled = demo_tokenizer.encode_batch(texts)
    assert os.environ[PARALLELISM_ENV] == "true"  # the caller's choice stands
    monkeypatch.delenv(PARALLELISM_ENV)
    serial_tokenization()
    assert os.environ[PARALLELISM_ENV] == "false"
    assert demo_tokenizer.encode_batch(texts) == pooled  # the library reads it at every call


def test_vocabulary_lookups(demo_tokenizer: Tokenizer) -> None:
    assert demo_tokenizer.vocab_size == 4096
    assert demo_tokenizer.id_to_token(demo_tokenizer.token_to_id("Ġthe") or -1) == "Ġthe"
    assert demo_tokenizer.token_to_id("no-such-token-xyz") is None
    assert demo_tokenizer.id_to_token(10**6) is None
    assert len(demo_tokenizer.special_token_ids) == 16


@pytest.mark.parametrize("skip", [True, False])
def test_byte_table_reproduces_decode_on_random_ids(demo_tokenizer: Tokenizer, skip: bool) -> None:
    table = demo_tokenizer.byte_table(skip)
    assert table is demo_tokenizer.byte_table(skip)  # cached
    rng = random.Random(3)
    for _ in range(500):
        ids = [rng.randrange(demo_tokenizer.vocab_size) for _ in range(rng.randint(1, 24))]
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text = "".join(decoder.decode(table[i]) for i in ids) + decoder.decode(b"", True)
        assert text == demo_tokenizer.decode(ids, skip_special_tokens=skip)


def test_byte_table_for_added_non_special_tokens() -> None:
    from tokenizers import AddedToken

    tokenizer = Tokenizer.from_file(demo_model_path() / "tokenizer.json")
    # An added token outside the byte alphabet (a space) decodes to its raw UTF-8.
    tokenizer.raw.add_tokens([AddedToken("<tool call>", special=False), "Ġhello"])
    tokenizer = Tokenizer(tokenizer.raw)
    table = tokenizer.byte_table()
    for token in ("<tool call>", "Ġhello"):
        token_id = tokenizer.token_to_id(token)
        assert token_id is not None
        assert table[token_id].decode() == tokenizer.decode([token_id])


def test_non_byte_level_tokenizer(sp_tokenizer: Tokenizer) -> None:
    assert not sp_tokenizer.is_byte_level
    with pytest.raises(ValueError):
        sp_tokenizer.byte_table()
    text = "hello world café 你好 🦄"
    assert sp_tokenizer.decode(sp_tokenizer.encode(text)) == text


def test_from_str(demo_tokenizer: Tokenizer) -> None:
    clone = Tokenizer.from_str(demo_tokenizer.raw.to_str())
    assert clone.encode(TEXTS[2]) == demo_tokenizer.encode(TEXTS[2])
    assert clone.is_byte_level


def test_token_texts_cover_complete_tokens_only(demo_tokenizer: Tokenizer) -> None:
    texts = demo_tokenizer.token_texts()
    assert texts is demo_tokenizer.token_texts()  # cached
    table = demo_tokenizer.byte_table()
    split = [i for i, data in enumerate(table) if i not in texts]
    assert split  # e.g. the pieces of emoji and rare CJK characters
    for token_id in split:
        assert "\ufffd" in demo_tokenizer.decode([token_id])
    for token_id, text in texts.items():
        assert text == demo_tokenizer.decode([token_id])

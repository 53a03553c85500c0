"""Guided decoding: random logits masked by the matcher always yield text in the language.

A byte-level BPE tokenizer is trained here on JSON-ish text (so multi-character tokens such as
``":`` or ``"},`` exist and the grammar must reason across token boundaries); every sample draws
standard-normal logits from a seeded generator (temperature 1), masks them, samples, and feeds
the token back until the matcher terminates or EOS is drawn.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import tokenizers  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from dynamo.preprocess.tokenizer import Tokenizer  # noqa: E402
from dynamo.protocol.request import GuidedDecodingOptions  # noqa: E402
from dynamo.pytorch.guided import (  # noqa: E402
    GuidedDecoder,
    GuidedMatcher,
    _mask_by_shifts,
    _mask_on_cpu,
    apply_token_bitmask_,
)
from dynamo.runtime.errors import InvalidArgument  # noqa: E402

EOS = 0
PAD = 37  # the model's logits are wider than the tokenizer's vocabulary
MAX_TOKENS = 2000  # random logits make long strings: all allowed tokens are near equally likely


def _corpus(rng: random.Random) -> Iterator[str]:
    # Mostly words and JSON punctuation, few numbers: with random logits every allowed token is
    # about equally likely, so a vocabulary full of digit tokens would make numbers endless.
    words = "name age city tags score active id value items true false null the of and".split()
    for _ in range(3000):
        record = {
            rng.choice(words): rng.choice(
                [rng.randint(0, 99), rng.choice(words), [rng.choice(words)], True, None]
            )
            for _ in range(rng.randint(1, 4))
        }
        yield json.dumps(record) + " " + json.dumps(record, separators=(",", ":"))
        yield " ".join(rng.choice(words) for _ in range(8)) + "."
    yield string.printable


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_corpus(random.Random(0)), trainer)
    assert raw.token_to_id("<|eos|>") == EOS
    return Tokenizer(raw)


@pytest.fixture(scope="module")
def decoder(tokenizer: Tokenizer) -> GuidedDecoder:
    return GuidedDecoder(tokenizer, tokenizer.vocab_size + PAD, [EOS], num_threads=1)


def sample(
    decoder: GuidedDecoder, matcher: GuidedMatcher, tokenizer: Tokenizer, seed: int, eos: int = EOS
) -> str | None:
    """Decoded text of one guided sample, or None if it ran past MAX_TOKENS."""
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = torch.randn(1, decoder.vocab_size, generator=generator)
        assert decoder.apply_masks(logits, [matcher])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generator))
        assert token < tokenizer.vocab_size, "a padding id was sampled"
        assert matcher.accept_token(token), matcher.error
        if token == eos:
            break
        ids.append(token)
        if matcher.is_terminated():
            break
    else:
        return None
    assert matcher.error is None
    return tokenizer.decode(ids)


def samples(
    decoder: GuidedDecoder,
    tokenizer: Tokenizer,
    options: GuidedDecodingOptions,
    n: int,
    eos: int = EOS,
) -> list[str]:
    texts = [sample(decoder, decoder.matcher(options), tokenizer, seed, eos) for seed in range(n)]
    finished = [text for text in texts if text is not None]
    assert len(finished) == n, f"{n - len(finished)} samples ran past {MAX_TOKENS} tokens"
    return finished


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", 'say "hi"']},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "null"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "score", "active", "kind", "tags", "address"],
    "additionalProperties": False,
}


def test_json_schema_samples_always_parse_and_validate(
    decoder: GuidedDecoder, tokenizer: Tokenizer
) -> None:
    texts = samples(decoder, tokenizer, GuidedDecodingOptions(json=SCHEMA), 50)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    # The samples really are random (not one forced string).
    assert len(set(texts)) == len(texts)


def test_json_schema_as_text(decoder: GuidedDecoder, tokenizer: Tokenizer) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}
    for text in samples(decoder, tokenizer, GuidedDecodingOptions(json=json.dumps(schema)), 10):
        jsonschema.validate(json.loads(text), schema)


def _sentencepiece_tokenizer() -> Tokenizer:
    """Llama-2 / Mistral style: Metaspace pieces, byte fallback for anything else (so 'é' and
    '你' exist only as <0xNN> byte tokens), EOS ``</s>``."""
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{byte:02X}>", 0.0) for byte in range(256)]
    pieces += [(char, -5.0) for char in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("▁", -4.0), ("▁" + "name", -2.0), ('":', -2.0), ('"', -3.0), ("true", -2.0)]
    raw = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    raw.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(raw)


def test_byte_fallback_tokenizer() -> None:
    tokenizer = _sentencepiece_tokenizer()
    eos = tokenizer.token_to_id("</s>")
    assert eos is not None
    decoder = GuidedDecoder(tokenizer, tokenizer.vocab_size + 3, [eos])
    for text in samples(decoder, tokenizer, GuidedDecodingOptions(json=SCHEMA), 20, eos):
        jsonschema.validate(json.loads(text), SCHEMA)
    choices = ["café 你好", "hello world", "naïve"]
    texts = samples(decoder, tokenizer, GuidedDecodingOptions(choice=choices), 20, eos)
    assert set(texts) == set(choices)


def test_json_object_samples_parse_to_objects(decoder: GuidedDecoder, tokenizer: Tokenizer) -> None:
    for text in samples(decoder, tokenizer, GuidedDecodingOptions(json_object=True), 50):
        assert isinstance(json.loads(text), dict)


def test_regex_samples_fullmatch(decoder: GuidedDecoder, tokenizer: Tokenizer) -> None:
    # [0-9], not \d: llguidance's \d follows a newer Unicode than this Python's re module.
    pattern = r"[a-z]{2,5}-[0-9]{1,3}(\.[0-9]{2})? (yes|no|maybe)!"
    texts = samples(decoder, tokenizer, GuidedDecodingOptions(regex=pattern), 30)
    for text in texts:
        assert re.fullmatch(pattern, text), text
    assert len(set(texts)) > 20


def test_choice_samples_are_choices(decoder: GuidedDecoder, tokenizer: Tokenizer) -> None:
    choices = ["red", "green", "blue", "dark blue", 'say "hi"\\n', "café", ""]
    texts = samples(decoder, tokenizer, GuidedDecodingOptions(choice=choices), 60)
    assert set(texts) <= set(choices)
    assert len(set(texts)) >= 4


def _is_sum(text: str) -> bool:
    """Whether ``text`` is a sum/difference of integers and parenthesised sums (no unary)."""
    if not re.fullmatch(r"[0-9+\-()]+", text):
        return False
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Constant)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num  ::= [1-9] [0-9]? [0-9]? | "0"
"""


def test_gbnf_grammar_samples_are_in_the_language(
    decoder: GuidedDecoder, tokenizer: Tokenizer
) -> None:
    texts = samples(decoder, tokenizer, GuidedDecodingOptions(grammar=GBNF), 30)
    assert all(_is_sum(text) for text in texts), texts
    assert any("(" in text for text in texts)
    assert not _is_sum("1+-2") and not _is_sum("(1")  # the checker can fail


def test_lark_grammar_samples_are_in_the_language(
    decoder: GuidedDecoder, tokenizer: Tokenizer
) -> None:
    lark = 'start: "[" item ("," item)* "]"\nitem: /[a-z]{1,4}/ | /[0-9]{1,2}/'
    for text in samples(decoder, tokenizer, GuidedDecodingOptions(grammar=lark), 20):
        assert re.fullmatch(r"\[([a-z]{1,4}|[0-9]{1,2})(,([a-z]{1,4}|[0-9]{1,2}))*\]", text)


@pytest.mark.parametrize(
    "options, message",
    [
        (GuidedDecodingOptions(regex="a(b"), "invalid guided regex"),
        (GuidedDecodingOptions(regex=r"(?=a)b"), "invalid guided regex"),
        (GuidedDecodingOptions(json={"type": "objekt"}), "invalid guided json schema"),
        (GuidedDecodingOptions(json={"type": "string", "pattern": "a("}), "json schema"),
        (GuidedDecodingOptions(json="{not json"), "not valid JSON"),
        (GuidedDecodingOptions(json=[1, 2]), "must be a JSON object"),
        (GuidedDecodingOptions(grammar='root ::= "a" | undefined'), "invalid guided grammar"),
        (GuidedDecodingOptions(grammar="start: foo"), "invalid guided grammar"),
        (GuidedDecodingOptions(grammar="root ::= ((("), "invalid guided grammar"),
        (GuidedDecodingOptions(choice=[]), "non-empty list of strings"),
        (GuidedDecodingOptions(choice=["a", 1]), "non-empty list of strings"),  # type: ignore[list-item]
        (GuidedDecodingOptions(), "exactly one"),
        (GuidedDecodingOptions(regex="a", choice=["a"]), "got regex, choice"),
    ],
)
def test_invalid_options_raise_invalid_argument(
    decoder: GuidedDecoder, options: GuidedDecodingOptions, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        decoder.matcher(options)


def test_mask_allows_eos_only_when_complete_and_never_padding(
    decoder: GuidedDecoder, tokenizer: Tokenizer
) -> None:
    matcher = decoder.matcher(GuidedDecodingOptions(regex=r"ab|abc"))
    mask = matcher.allowed_mask()
    assert mask.shape == (decoder.vocab_size,) and mask.dtype == torch.bool
    assert not mask[EOS] and not mask[tokenizer.vocab_size :].any()
    for token in tokenizer.encode("ab"):
        assert matcher.allowed_mask()[token]
        assert matcher.accept_token(token)
    assert matcher.is_accepting() and not matcher.is_terminated()
    allowed = set(matcher.allowed_mask().nonzero().flatten().tolist())
    assert allowed == {EOS, tokenizer.token_to_id("c")}
    assert matcher.accept_token(tokenizer.encode("c")[0]) and matcher.is_terminated()
    assert matcher.rollback(1) and not matcher.is_terminated() and matcher.is_accepting()
    matcher.reset()
    assert not matcher.is_accepting()


def test_rejected_token_leaves_an_error_state_that_allows_only_eos(
    decoder: GuidedDecoder, tokenizer: Tokenizer
) -> None:
    matcher = decoder.matcher(GuidedDecodingOptions(choice=["yes", "no"]))
    bad = tokenizer.token_to_id("x")
    assert bad is not None and not matcher.allowed_mask()[bad]
    assert not matcher.accept_token(bad)
    assert matcher.error and matcher.is_terminated()
    assert matcher.allowed_mask().nonzero().flatten().tolist() == [EOS]


def test_cached_grammar_gives_independent_matchers(
    decoder: GuidedDecoder, tokenizer: Tokenizer
) -> None:
    options = GuidedDecodingOptions(choice=["yes", "no"])
    first, second = decoder.matcher(options), decoder.matcher(options)
    for token in tokenizer.encode("yes"):
        assert first.accept_token(token)
    assert first.is_terminated() and not second.is_accepting()
    assert second.allowed_mask()[tokenizer.encode("no")[0]]


async def test_matcher_async_compiles_off_the_loop_and_reports_errors(
    decoder: GuidedDecoder, tokenizer: Tokenizer
) -> None:
    options = GuidedDecodingOptions(regex=r"async-[0-9]")
    first = await decoder.matcher_async(options)
    second = await decoder.matcher_async(options)  # cached: copied inline
    for token in tokenizer.encode("async-7"):
        assert first.accept_token(token)
    assert first.is_terminated() and not second.is_accepting()
    with pytest.raises(InvalidArgument):
        await decoder.matcher_async(GuidedDecodingOptions(regex="(("))


def test_cache_evicts_least_recently_used(tokenizer: Tokenizer) -> None:
    decoder = GuidedDecoder(tokenizer, tokenizer.vocab_size, [EOS], cache_size=2)
    a, b, c = (GuidedDecodingOptions(choice=[word]) for word in ("a", "b", "c"))
    for options in (a, b, a, c):  # b is the least recently used when c arrives
        decoder.matcher(options)
    assert decoder.cached == 2
    assert decoder.matcher(a).allowed_mask()[tokenizer.encode("a")[0]]


def test_apply_masks_batches_guided_rows_and_leaves_others(
    decoder: GuidedDecoder, tokenizer: Tokenizer
) -> None:
    regex = decoder.matcher(GuidedDecodingOptions(regex=r"[0-9]+"))
    json_object = decoder.matcher(GuidedDecodingOptions(json_object=True))
    logits = torch.randn(3, decoder.vocab_size, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    assert decoder.apply_masks(logits, [regex, None, json_object])
    assert torch.equal(logits[1], original[1])
    for row, matcher in ((0, regex), (2, json_object)):
        expected = original[row].clone()
        matcher.mask_logits(expected)
        assert torch.equal(logits[row], expected)
        assert torch.equal(torch.isfinite(logits[row]), matcher.allowed_mask())
    assert not decoder.apply_masks(logits, [None, None, None])
    with pytest.raises(ValueError):
        decoder.apply_masks(logits, [regex])


def test_accept_tokens_batches_guided_rows(decoder: GuidedDecoder, tokenizer: Tokenizer) -> None:
    digits = decoder.matcher(GuidedDecodingOptions(regex=r"[0-9]+"))
    word = decoder.matcher(GuidedDecodingOptions(choice=["yes"]))
    seven, x = tokenizer.encode("7")[0], tokenizer.encode("x")[0]
    assert decoder.accept_tokens([digits, None, word], [seven, x, x]) == [True, True, False]
    assert digits.is_accepting() and word.error is not None
    with pytest.raises(ValueError):
        decoder.accept_tokens([digits], [seven, seven])


def test_bf16_logits_and_fill_bitmask_rows(decoder: GuidedDecoder) -> None:
    matcher = decoder.matcher(GuidedDecodingOptions(regex=r"[0-9]+"))
    bitmask = decoder.allocate_bitmask(2)
    matcher.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all() and not (bitmask[1] == -1).all()
    logits = torch.zeros(decoder.vocab_size, dtype=torch.bfloat16)
    matcher.mask_logits(logits)
    assert torch.equal(torch.isfinite(logits), matcher.allowed_mask())
    with pytest.raises(ValueError):
        matcher.fill_bitmask(torch.zeros(1, 3, dtype=torch.int32), 0)


def test_cpu_and_device_unpacking_agree_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 40), dtype=torch.int32, generator=generator)
    bitmask[0] = -1  # all allowed, bit 31 included
    bitmask[1] = 0
    bitmask[2, 0] = -(2**31)  # only bit 31 of word 0
    logits = torch.randn(4, 40 * 32 - 5, generator=generator)
    on_cpu, by_shifts = logits.clone(), logits.clone()
    _mask_on_cpu(on_cpu, bitmask)
    _mask_by_shifts(by_shifts, bitmask)
    assert torch.equal(on_cpu, by_shifts)
    expected = [
        [bool(int(bitmask[row, token // 32]) >> (token % 32) & 1) for token in range(40 * 32 - 5)]
        for row in range(4)
    ]
    assert torch.isfinite(on_cpu).tolist() == expected
    assert torch.equal(on_cpu[0], logits[0])
    with pytest.raises(ValueError):
        apply_token_bitmask_(logits, bitmask[:, :30])

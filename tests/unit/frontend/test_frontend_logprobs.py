"""Log-probabilities and echo: collecting the engine's numbers per choice, and OpenAI's shapes
(checked against the official ``openai`` types), streamed chunks folding to the unary body."""

from __future__ import annotations

from typing import Any

import msgspec
import openai.types as oa
import openai.types.chat as oa_chat
import pytest
from openai._models import construct_type

from dynamo.frontend.logprobs import EchoPrompt, LogprobCollector, ResponseExtras, TokenLogprobs
from dynamo.frontend.streaming import ChatFormatter, CompletionFormatter, usage
from dynamo.preprocess import Tokenizer, demo_model_path, load_model_dir
from dynamo.protocol.output import LLMEngineOutput, TopLogprob
from dynamo.protocol.request import OutputOptions
from dynamo.runtime.errors import Unknown
from tests.fakes import make_request


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_model_dir(demo_model_path()).tokenizer


def chunk(ids: list[int], base: float = -1.0, top: int = 2) -> LLMEngineOutput:
    return LLMEngineOutput(
        token_ids=ids,
        log_probs=[base - i for i in range(len(ids))],
        top_logprobs=[[TopLogprob(t + k, base - k) for k in range(top)] for t in ids],
    )


def test_collector_hands_out_only_consumed_tokens() -> None:
    col = LogprobCollector(top=1, want_prompt=False)
    col.add(chunk([10, 11, 12]))
    first = col.take(2)
    assert first.token_ids == [10, 11] and first.logprobs == [-1.0, -2.0]
    assert first.top == [[TopLogprob(10, -1.0)], [TopLogprob(11, -1.0)]]  # cut to top=1
    col.add(chunk([13]))
    assert col.take(3).token_ids == [12]  # 13 came after the stop: never handed out
    assert col.take(3).token_ids == []


def test_collector_without_top_and_prompt() -> None:
    col = LogprobCollector(top=0, want_prompt=True)
    col.add(LLMEngineOutput(prompt_logprobs=[None, -0.5]))
    col.add(LLMEngineOutput(token_ids=[5], log_probs=[-0.25]))
    piece = col.take(1)
    assert piece.prompt == [None, -0.5] and piece.top == [[]]
    assert col.take(1).prompt is None  # the prompt's only once


def test_collector_refuses_an_engine_that_left_them_out() -> None:
    col = LogprobCollector(top=0, want_prompt=False)
    with pytest.raises(Unknown):
        col.add(LLMEngineOutput(token_ids=[1, 2], log_probs=[-1.0]))
    col = LogprobCollector(top=2, want_prompt=False)
    with pytest.raises(Unknown):
        col.add(LLMEngineOutput(token_ids=[1], log_probs=[-1.0]))
    col = LogprobCollector(top=0, want_prompt=True)
    with pytest.raises(Unknown):
        col.take(0)


def test_collector_for_request() -> None:
    assert LogprobCollector.for_request(make_request()) is None
    req = make_request(output=OutputOptions(logprobs=3, prompt_logprobs=3))
    assert LogprobCollector.for_request(req) is not None


def test_chat_shape_token_strings_and_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("héllo 你好")
    lp = TokenLogprobs(ids, [-0.5] * len(ids), [[TopLogprob(i, -0.5)] for i in ids])
    out = ResponseExtras(tok).chat(lp)
    assert out is not None and out.content is not None
    assert [e.token for e in out.content] == [tok.decode([i]) for i in ids]
    # the bytes of all tokens are exactly the text's, even where a token splits a character
    joined = b"".join(bytes(e.bytes or []) for e in out.content)
    assert joined.decode() == "héllo 你好"
    assert all(e.top_logprobs[0].token == e.token for e in out.content)
    parsed = oa_chat.chat_completion.ChoiceLogprobs.model_validate(msgspec.to_builtins(out))
    assert parsed.content is not None and parsed.content[0].logprob == -0.5


def test_completion_offsets_and_echo_across_pieces(tok: Tokenizer) -> None:
    prompt_ids = tok.encode("Hi there", add_special_tokens=True)  # BOS first
    extras = ResponseExtras(tok, echo=[EchoPrompt("Hi there", prompt_ids)])
    big, world = tok.encode(" big"), tok.encode(" world")
    prompt_lps: list[float | None] = [None] + [-1.0] * (len(prompt_ids) - 1)
    first = TokenLogprobs(
        big, [-0.1] * len(big), [[TopLogprob(big[0], -0.1)]] * len(big), prompt=prompt_lps
    )
    text1, lp1 = extras.completion(0, " big", first)
    assert text1 == "Hi there big"
    assert lp1 is not None
    n = len(prompt_ids)
    assert lp1.token_logprobs[0] is None and lp1.top_logprobs[0] is None
    assert lp1.tokens[0] == tok.decode([prompt_ids[0]], skip_special_tokens=False)
    assert lp1.text_offset[:2] == [0, 0]  # BOS adds nothing to the text
    assert lp1.text_offset[n] == len("Hi there")
    second = TokenLogprobs(world, [-0.2] * len(world), [[] for _ in world])
    text2, lp2 = extras.completion(0, " world", second)
    assert text2 == " world"  # echoed once
    assert lp2 is not None and lp2.text_offset[0] == len("Hi there big")
    assert lp2.top_logprobs == [{} for _ in world]
    full = text1 + text2
    tokens, offsets = lp1.tokens[n:] + lp2.tokens, lp1.text_offset[n:] + lp2.text_offset
    for token, offset in zip(tokens, offsets, strict=True):
        assert full[offset : offset + len(token)] == token


def test_echo_without_logprobs(tok: Tokenizer) -> None:
    extras = ResponseExtras(tok, echo=[EchoPrompt("A", [1]), EchoPrompt("B", [2])])
    assert extras.completion(1, "x", None) == ("Bx", None)
    assert extras.completion(1, "y", None) == ("y", None)
    assert extras.completion(0, "", None) == ("A", None)


def _events(raw: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for blob in raw:
        for line in blob.split(b"\n"):
            if line.startswith(b"data: {"):
                out.append(msgspec.json.decode(line[6:]))
    return out


def test_chat_stream_folds_to_unary_and_parses(tok: Tokenizer) -> None:
    ids = tok.encode("one two three")
    pieces = [
        TokenLogprobs(ids[:1], [-0.1], [[TopLogprob(ids[0], -0.1), TopLogprob(9, -2.0)]]),
        TokenLogprobs(ids[1:], [-0.2] * (len(ids) - 1), [[TopLogprob(i, -0.2)] for i in ids[1:]]),
    ]
    fmt = ChatFormatter("chatcmpl-1", "demo", 1, ResponseExtras(tok))
    raw = [
        fmt.delta_chunk(0, "one", None, pieces[0]),
        fmt.delta_chunk(0, " two three", "stop", pieces[1]),
    ]
    streamed = []
    for event in _events(raw):
        parsed = oa_chat.ChatCompletionChunk.model_validate(event)
        assert parsed.choices[0].logprobs is not None
        streamed += parsed.choices[0].logprobs.content or []
    body = fmt.response(
        ["one two three"], ["stop"], usage(3, len(ids), None), None, [TokenLogprobs.concat(pieces)]
    )
    unary = oa_chat.ChatCompletion.model_validate_json(body)
    assert unary.choices[0].logprobs is not None
    assert unary.choices[0].logprobs.content == streamed
    assert [e.token for e in streamed] == [tok.decode([i]) for i in ids]


def test_completion_stream_folds_to_unary_and_parses(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta")
    pieces = [
        TokenLogprobs(ids[:1], [-0.3], [[TopLogprob(ids[0], -0.3)]], prompt=[None, -1.0, -1.5]),
        TokenLogprobs(ids[1:], [-0.4] * (len(ids) - 1), [[TopLogprob(i, -0.4)] for i in ids[1:]]),
    ]
    prompt = EchoPrompt("go", tok.encode("go", add_special_tokens=True))
    assert len(prompt.token_ids) == 3  # BOS, g, o
    stream_fmt = CompletionFormatter("cmpl-1", "demo", 1, ResponseExtras(tok, echo=[prompt]))
    raw = [
        stream_fmt.delta_chunk(0, "alpha", None, pieces[0]),
        stream_fmt.delta_chunk(0, " beta", "length", pieces[1]),
    ]
    text, tokens, offsets = "", [], []
    for event in _events(raw):
        # as the client parses a response (OpenAI's own echo puts null first, which its strict
        # types do not admit, so the client does not validate)
        completion = construct_type(type_=oa.Completion, value=event)
        assert isinstance(completion, oa.Completion)
        choice = completion.choices[0]
        assert choice.logprobs is not None
        text += choice.text
        tokens += choice.logprobs.tokens or []
        offsets += choice.logprobs.text_offset or []
    unary_fmt = CompletionFormatter("cmpl-1", "demo", 1, ResponseExtras(tok, echo=[prompt]))
    body = unary_fmt.response(
        ["alpha beta"], ["length"], usage(2, 2, None), None, [TokenLogprobs.concat(pieces)]
    )
    parsed = construct_type(type_=oa.Completion, value=msgspec.json.decode(body))
    assert isinstance(parsed, oa.Completion)
    unary = parsed.choices[0]
    assert unary.text == text == "goalpha beta"
    assert unary.logprobs is not None
    assert unary.logprobs.tokens == tokens and unary.logprobs.text_offset == offsets
    assert unary.logprobs.token_logprobs is not None
    assert unary.logprobs.token_logprobs[:4] == [None, -1.0, -1.5, -0.3]

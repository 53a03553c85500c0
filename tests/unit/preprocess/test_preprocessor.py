"""Preprocessor: chat and completion inputs -> PreprocessedRequest, limits, errors, detokenizer."""

from __future__ import annotations

import pytest

from dynamo.preprocess import GenerationParams, ModelDir, Preprocessor, load_model_dir
from dynamo.protocol.output import FinishReason
from dynamo.protocol.request import GuidedDecodingOptions, OutputOptions, RoutingHints
from dynamo.runtime.errors import InvalidArgument

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def pre(demo_model: ModelDir) -> Preprocessor:
    return Preprocessor(demo_model, served_model_name="demo")


def test_chat_tokenizes_the_rendered_template(pre: Preprocessor, demo_model: ModelDir) -> None:
    prepared = pre.chat(MESSAGES, GenerationParams())
    assert demo_model.chat_template is not None
    text = demo_model.chat_template.render(MESSAGES, add_generation_prompt=True)
    assert prepared.formatted_prompt == text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = prepared.request.token_ids
    assert ids == demo_model.tokenizer.encode(text)
    assert ids[0] == demo_model.bos_token_id and ids.count(demo_model.bos_token_id) == 1
    assert prepared.request.model == "demo"
    assert prepared.request.eos_token_ids == list(demo_model.eos_token_ids)
    assert prepared.request.stop.max_tokens == 8192 - len(ids)  # default: rest of the context


def test_generation_prompt_default_follows_last_role(pre: Preprocessor) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": "Paris"}]
    assert not (pre.chat(history, GenerationParams()).formatted_prompt or "").endswith("\n\n")
    forced = pre.chat(history, GenerationParams(), add_generation_prompt=True)
    assert (forced.formatted_prompt or "").endswith("assistant<|end_header_id|>\n\n")
    cont = pre.chat(history, GenerationParams(), continue_final_message=True)
    assert (cont.formatted_prompt or "").endswith("Paris")


def test_chat_passes_tools_and_template_kwargs(pre: Preprocessor) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    prepared = pre.chat(MESSAGES, GenerationParams(), tools=tools)
    assert '"name": "lookup"' in (prepared.formatted_prompt or "")
    custom = pre.chat(
        MESSAGES, GenerationParams(), chat_template_kwargs={"bos_token": "<|end_of_text|>"}
    )
    assert (custom.formatted_prompt or "").startswith("<|end_of_text|>")


def test_use_raw_prompt_skips_the_template(pre: Preprocessor, demo_model: ModelDir) -> None:
    messages = [
        {"role": "user", "content": "raw "},
        {"role": "user", "content": [{"type": "text", "text": "text"}]},
    ]
    prepared = pre.chat(messages, GenerationParams(), use_raw_prompt=True)
    assert prepared.formatted_prompt == "raw text"
    tok = demo_model.tokenizer
    assert prepared.request.token_ids == tok.encode("raw text", add_special_tokens=True)


def test_limits_and_sampling_fields(pre: Preprocessor) -> None:
    params = GenerationParams(
        max_tokens=50,
        min_tokens=5,
        stop=["</s>", ""],
        stop_token_ids=[7],
        ignore_eos=True,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=1,
        repetition_penalty=1.1,
        greedy=True,
        n=2,
        annotations=["formatted_prompt"],
        request_id="req-1",
        routing=RoutingHints(backend_instance_id=3),
    )
    prepared = pre.chat(MESSAGES, params)
    req = prepared.request
    assert (req.stop.max_tokens, req.stop.min_tokens) == (50, 5)
    assert req.stop.stop_token_ids == [7] and req.stop.ignore_eos
    assert prepared.stop == ["</s>"]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.repetition_penalty) == (0.5, 0.9, 40, 1, 1.1)
    assert s.greedy and s.n == 2
    assert req.annotations == ["formatted_prompt"] and req.request_id == "req-1"
    assert req.routing == RoutingHints(backend_instance_id=3)
    assert pre.chat(MESSAGES, GenerationParams(stop="END")).stop == ["END"]


def test_engine_fields_reach_the_request(pre: Preprocessor) -> None:
    guided = GuidedDecodingOptions(regex="[0-9]+")
    params = GenerationParams(
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        guided_decoding=guided,
        logprobs=3,
        prompt_logprobs=2,
    )
    req = pre.completion("hello", params)[0].request
    s = req.sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty) == (0.05, 0.5, -0.5)
    assert s.guided_decoding == guided
    assert req.output == OutputOptions(logprobs=3, prompt_logprobs=2)
    plain = pre.completion("hello", GenerationParams())[0].request
    assert plain.output == OutputOptions() and plain.sampling.guided_decoding is None


def test_max_tokens_beyond_the_context_is_refused_with_the_lengths(demo_model: ModelDir) -> None:
    small = Preprocessor(demo_model, served_model_name="demo", context_length=64)
    assert small.context_length == 64
    prompt_tokens = small.completion("hello world", GenerationParams())[0].num_prompt_tokens
    room = 64 - prompt_tokens
    with pytest.raises(InvalidArgument) as info:
        small.completion("hello world", GenerationParams(max_tokens=1000, min_tokens=900))
    message = str(info.value)
    assert "1000" in message and "64" in message and f"{prompt_tokens} input tokens" in message
    exact = small.completion("hello world", GenerationParams(max_tokens=room))[0]
    assert exact.request.stop.max_tokens == room
    unset = small.completion("hello world", GenerationParams(min_tokens=900))[0]
    assert unset.request.stop.max_tokens == room and unset.request.stop.min_tokens == room


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_a_message_without_content_is_refused(demo_model: ModelDir, role: str) -> None:
    pre = Preprocessor(demo_model, served_model_name="demo")
    messages = [{"role": "user", "content": "hi"}, {"role": role}]
    with pytest.raises(InvalidArgument, match=rf"messages\[1\]: a '{role}' message must have"):
        pre.chat(messages, GenerationParams())
    # an assistant turn may carry tool calls instead of content
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": []}]
    pre.chat([*ok, {"role": "user", "content": "and?"}], GenerationParams())


def test_developer_is_rendered_as_system(demo_model: ModelDir) -> None:
    pre = Preprocessor(demo_model, served_model_name="demo")
    as_dev = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    as_sys = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    dev = pre.chat(as_dev, GenerationParams())
    assert dev.formatted_prompt == pre.chat(as_sys, GenerationParams()).formatted_prompt
    assert as_dev[0]["role"] == "developer", "the caller's messages are not modified"


@pytest.mark.parametrize(
    "params",
    [
        GenerationParams(max_tokens=0),
        GenerationParams(max_tokens=-5),
        GenerationParams(min_tokens=-1),
        GenerationParams(max_tokens=5, min_tokens=6),
        GenerationParams(n=0),
    ],
)
def test_invalid_params(pre: Preprocessor, params: GenerationParams) -> None:
    with pytest.raises(InvalidArgument):
        pre.completion("hi", params)


def test_prompt_at_or_over_context_is_invalid(demo_model: ModelDir) -> None:
    small = Preprocessor(demo_model, served_model_name="demo", context_length=16)
    with pytest.raises(InvalidArgument, match="maximum context length is 16"):
        small.completion(list(range(16)), GenerationParams())
    assert small.completion(list(range(15)), GenerationParams())[0].request.stop.max_tokens == 1
    with pytest.raises(InvalidArgument):
        small.chat([{"role": "user", "content": "word " * 50}], GenerationParams())


def test_completion_prompt_forms(pre: Preprocessor, demo_model: ModelDir) -> None:
    tok = demo_model.tokenizer
    [single] = pre.completion("Once upon a time", GenerationParams())
    assert single.request.token_ids == tok.encode("Once upon a time", add_special_tokens=True)
    assert single.formatted_prompt == "Once upon a time"
    [ids] = pre.completion([5, 6, 7], GenerationParams())
    assert ids.request.token_ids == [5, 6, 7] and ids.formatted_prompt is None
    texts = pre.completion(["a", "b c"], GenerationParams())
    assert [p.formatted_prompt for p in texts] == ["a", "b c"]
    batch = pre.completion([[1, 2], [3]], GenerationParams())
    assert [p.request.token_ids for p in batch] == [[1, 2], [3]]
    no_bos = pre.completion("x", GenerationParams(), add_special_tokens=False)[0]
    assert no_bos.request.token_ids == tok.encode("x")


@pytest.mark.parametrize(
    "prompt",
    [[], [[]], ["a", [1]], [1, "a"], [4096], [-1], [True], [[1], "a"], "", 5],
)
def test_invalid_completion_prompts(pre: Preprocessor, prompt: object) -> None:
    with pytest.raises(InvalidArgument):
        pre.completion(prompt, GenerationParams(), add_special_tokens=False)  # type: ignore[arg-type]


def test_chat_errors(pre: Preprocessor) -> None:
    with pytest.raises(InvalidArgument):
        pre.chat([], GenerationParams())
    with pytest.raises(InvalidArgument, match="Unsupported role"):
        pre.chat([{"role": "robot", "content": "x"}], GenerationParams())


def test_model_without_template_rejects_chat(demo_model: ModelDir) -> None:
    bare = ModelDir(
        path=demo_model.path,
        tokenizer=demo_model.tokenizer,
        chat_template=None,
        context_length=100,
        vocab_size=demo_model.vocab_size,
        tokenizer_checksum="x",
    )
    with pytest.raises(InvalidArgument, match="no chat template"):
        Preprocessor(bare, served_model_name="bare").chat(MESSAGES, GenerationParams())


def test_detokenizer_is_wired_to_the_request(pre: Preprocessor, demo_model: ModelDir) -> None:
    tok = demo_model.tokenizer
    eot = demo_model.eos_token_ids[0]
    prepared = pre.chat(MESSAGES, GenerationParams(stop=[" City"], min_tokens=1))
    detok = pre.detokenizer(prepared)
    assert detok.add(tok.encode("Paris.")).text == "Paris."
    assert detok.add([eot]).finished == FinishReason.STOP
    detok = pre.detokenizer(prepared)
    assert detok.add(tok.encode("Paris City")).text == "Paris"
    ignoring = pre.detokenizer(pre.chat(MESSAGES, GenerationParams(ignore_eos=True)))
    assert ignoring.add([eot, *tok.encode("x")]).finished is None


def test_load_model_dir_context_override(demo_model: ModelDir) -> None:
    model = load_model_dir(demo_model.path, context_length=512)
    assert Preprocessor(model, served_model_name="m").context_length == 512


def test_messages_may_be_msgspec_structs(pre: Preprocessor) -> None:
    from dynamo.protocol.openai import ChatMessage

    structs = [ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    as_structs = pre.chat(structs, GenerationParams())
    assert as_structs.request.token_ids == pre.chat(MESSAGES, GenerationParams()).request.token_ids
    history = [*structs, ChatMessage(role="assistant", content="Paris")]
    assert (pre.chat(history, GenerationParams()).formatted_prompt or "").endswith(
        "Paris<|eot_id|>"
    )
    raw = pre.chat(structs, GenerationParams(), use_raw_prompt=True)
    assert raw.formatted_prompt == "Be brief.What is the capital of France?"


def test_chat_template_kwargs_override_options(pre: Preprocessor) -> None:
    user = [{"role": "user", "content": "hi"}]
    text = pre.render_chat(user, chat_template_kwargs={"add_generation_prompt": False})
    assert text.endswith("hi<|eot_id|>")
    with pytest.raises(InvalidArgument):
        pre.render_chat(user, chat_template_kwargs={"messages": []})
    with pytest.raises(InvalidArgument):
        pre.render_chat(user, chat_template_kwargs={"continue_final_message": "yes"})

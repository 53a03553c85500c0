"""Our request as vLLM ``SamplingParams`` arguments (no vLLM needed)."""

from __future__ import annotations

import pytest

from dynamo.protocol.request import (
    GuidedDecodingOptions,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo.runtime.errors import InvalidArgument
from dynamo.vllm.sampling import sampling_kwargs


def request(**kw: object) -> PreprocessedRequest:
    return PreprocessedRequest(model="m", token_ids=[1, 2, 3], **kw)  # type: ignore[arg-type]


def test_fields_map_and_defaults_are_vllms() -> None:
    kw = sampling_kwargs(
        request(
            sampling=SamplingOptions(
                temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3, presence_penalty=0.5,
                frequency_penalty=-0.5, repetition_penalty=1.1,
                guided_decoding=GuidedDecodingOptions(choice=["a", "b"]),
            ),
            stop=StopConditions(max_tokens=8, min_tokens=2, stop_token_ids=[9], ignore_eos=True),
            output=OutputOptions(logprobs=2, prompt_logprobs=0),
        ),
        context_length=64,
    )  # fmt: skip
    assert kw == {
        "n": 1,
        "max_tokens": 8,
        "min_tokens": 2,
        "stop_token_ids": [9],
        "ignore_eos": True,
        "detokenize": False,
        "skip_special_tokens": False,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "seed": 3,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logprobs": 2,
        "prompt_logprobs": 0,
        "structured_outputs": {"choice": ["a", "b"]},
    }
    plain = sampling_kwargs(request(sampling=SamplingOptions(greedy=True)), context_length=64)
    assert plain["temperature"] == 0.0 and plain["max_tokens"] == 61  # the room left
    assert "top_p" not in plain and "logprobs" not in plain


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"stop": StopConditions(max_tokens=62)}, "exceeds the context length"),
        ({"stop": StopConditions(max_tokens=0)}, "at least 1"),
        ({"sampling": SamplingOptions(presence_penalty=3.0)}, "presence_penalty"),
        ({"output": OutputOptions(logprobs=21)}, "logprobs must be in"),
        ({"token_ids": []}, "empty"),
    ],
)
def test_bad_requests_are_invalid_arguments(kw: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"model": "m", "token_ids": [1, 2, 3]}
    with pytest.raises(InvalidArgument, match=message):
        sampling_kwargs(PreprocessedRequest(**{**base, **kw}), context_length=64)  # type: ignore[arg-type]

"""``check_request``: an engine refuses, by PreprocessedRequest field, what its card does not
advertise; neutral values need nothing."""

from __future__ import annotations

import pytest

from dynamo.backend.capabilities import check_request
from dynamo.protocol.model_card import EngineCapabilities
from dynamo.protocol.request import GuidedDecodingOptions, OutputOptions, SamplingOptions
from dynamo.runtime.errors import InvalidArgument
from tests.fakes import make_request

ALL = EngineCapabilities(
    logprobs=True,
    max_top_logprobs=4,
    prompt_logprobs=True,
    min_p=True,
    repetition_penalty=True,
    presence_penalty=True,
    frequency_penalty=True,
    guided_decoding=True,
)

CASES = [
    (dict(sampling=SamplingOptions(min_p=0.1)), "sampling.min_p"),
    (dict(sampling=SamplingOptions(presence_penalty=1.0)), "sampling.presence_penalty"),
    (dict(sampling=SamplingOptions(frequency_penalty=1.0)), "sampling.frequency_penalty"),
    (dict(sampling=SamplingOptions(repetition_penalty=1.3)), "sampling.repetition_penalty"),
    (
        dict(sampling=SamplingOptions(guided_decoding=GuidedDecodingOptions(json_object=True))),
        "sampling.guided_decoding",
    ),
    (dict(output=OutputOptions(logprobs=0)), "output.logprobs"),
    (dict(output=OutputOptions(prompt_logprobs=0)), "output.prompt_logprobs"),
]


@pytest.mark.parametrize(("fields", "param"), CASES)
def test_refused_without_the_capability(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_request(make_request(**fields), EngineCapabilities())
    assert info.value.param == param
    check_request(make_request(**fields), ALL)


def test_limits_and_neutral_values() -> None:
    neutral = SamplingOptions(
        min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0
    )
    check_request(make_request(sampling=neutral), EngineCapabilities())
    with pytest.raises(InvalidArgument) as info:
        check_request(make_request(output=OutputOptions(logprobs=5)), ALL)
    assert info.value.param == "output.logprobs"
    with pytest.raises(InvalidArgument):
        check_request(make_request(output=OutputOptions(prompt_logprobs=5)), ALL)

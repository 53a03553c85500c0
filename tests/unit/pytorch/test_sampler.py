"""The sampler on hand-made logits: greedy, top_k / top_p / min_p, penalties, min_tokens,
the constraint seam, log-probabilities."""

from __future__ import annotations

import pytest
import torch

from dynamo.protocol.request import (
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo.pytorch.sampler import (
    RequestSampler,
    SampleRow,
    SamplingParams,
    make_generator,
    sample,
)
from dynamo.runtime.errors import InvalidArgument


def row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    *,
    seed: int = 0,
    stop: frozenset[int] = frozenset(),
    constraint: object = None,
) -> SampleRow:
    sampler = RequestSampler(params, make_generator(seed, torch.device("cpu")), stop, constraint)  # type: ignore[arg-type]
    return SampleRow(sampler, prompt or [], output or [])


def logits(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


def test_greedy_takes_the_argmax_and_logprobs_are_raw() -> None:
    [s] = sample(logits(1.0, 3.0, 2.0), [row(SamplingParams(temperature=0.0, logprobs=2))])
    expected = torch.log_softmax(torch.tensor([1.0, 3.0, 2.0]), -1)
    assert s.token == 1 and s.logprob == pytest.approx(float(expected[1]))
    assert [t.token_id for t in s.top] == [1, 2]


def test_top_k_1_top_p_tiny_and_min_p_high_all_pick_the_most_likely() -> None:
    values = (0.0, 2.0, 1.9, 1.8)
    for params in (
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.01),
        SamplingParams(min_p=0.99),
    ):
        picks = {sample(logits(*values), [row(params, seed=s)])[0].token for s in range(30)}
        assert picks == {1}, params


def test_temperature_sampling_follows_the_distribution_and_the_seed() -> None:
    params = SamplingParams(temperature=1.0)
    a = [sample(logits(0.0, 0.0, 0.0, 0.0), [row(params, seed=s)])[0].token for s in range(200)]
    b = [sample(logits(0.0, 0.0, 0.0, 0.0), [row(params, seed=s)])[0].token for s in range(200)]
    assert a == b and set(a) == {0, 1, 2, 3}


def test_penalties() -> None:
    base = (2.0, 1.5, 1.0, -1.0)
    # Repetition: seen tokens (prompt or output) lose: 2.0 / 4 < 1.5.
    [s] = sample(logits(*base), [row(SamplingParams(temperature=0.0, repetition_penalty=4.0), [0])])
    assert s.token == 1
    # Frequency: each occurrence in the output costs 0.3: token 0 seen twice -> 1.4 < 1.5.
    p = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert sample(logits(*base), [row(p, output=[0, 0])])[0].token == 1
    assert sample(logits(*base), [row(p, prompt=[0, 0])])[0].token == 0  # prompt: no effect
    # Presence: once is enough.
    p = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert sample(logits(*base), [row(p, output=[0])])[0].token == 1


def test_min_tokens_masks_stop_ids_and_constraint_masks_the_rest() -> None:
    p = SamplingParams(temperature=0.0, min_tokens=2)
    assert sample(logits(0.0, 5.0, 1.0), [row(p, output=[2], stop=frozenset({1}))])[0].token == 2
    assert sample(logits(0.0, 5.0, 1.0), [row(p, output=[2, 2], stop=frozenset({1}))])[0].token == 1

    class OnlyZero:
        def mask_logits(self, values: torch.Tensor) -> None:
            values[1:] = float("-inf")

        def accept_token(self, token_id: int) -> None:
            pass

    p = SamplingParams(temperature=1.0)
    assert sample(logits(0.0, 5.0, 1.0), [row(p, constraint=OnlyZero())])[0].token == 0


def test_params_from_request_validate() -> None:
    def req(**kw: object) -> PreprocessedRequest:
        return PreprocessedRequest(model="m", token_ids=[1], sampling=SamplingOptions(**kw))  # type: ignore[arg-type]

    assert SamplingParams.from_request(req(greedy=True)).is_greedy
    assert SamplingParams.from_request(req()).temperature == 1.0
    for bad in (
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 2.0},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 3.0},
    ):
        with pytest.raises(InvalidArgument):
            SamplingParams.from_request(req(**bad))
    r = req()
    r.output = OutputOptions(logprobs=21)
    with pytest.raises(InvalidArgument):
        SamplingParams.from_request(r)
    r = req()
    r.stop = StopConditions(min_tokens=3)
    assert SamplingParams.from_request(r).min_tokens == 3

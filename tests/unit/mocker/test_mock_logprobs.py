"""The mocker's log-probabilities: aligned with its tokens, a consistent distribution per
position, deterministic per seed; and it refuses what its card does not advertise."""

from __future__ import annotations

import math

import msgspec
import pytest
from mocker_sim import make_request

from dynamo.mocker.config import MockerConfig
from dynamo.mocker.engine import MockerEngine
from dynamo.mocker.logprobs import CAPABILITIES, MAX_TOP_LOGPROBS, MockLogprobs
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import (
    GuidedDecodingOptions,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
)
from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument


def asking(
    top: int | None, prompt: int | None = None, seed: int | None = 5, n: int = 12
) -> PreprocessedRequest:
    return msgspec.structs.replace(
        make_request(20, n),
        request_id="r",
        sampling=SamplingOptions(seed=seed),
        output=OutputOptions(logprobs=top, prompt_logprobs=prompt),
    )


async def run(request: PreprocessedRequest) -> list[LLMEngineOutput]:
    engine = MockerEngine(MockerConfig(speedup_ratio=0.0))
    await engine.start(1)
    try:
        return [out async for out in engine.generate(request, Context())]
    finally:
        await engine.cleanup()


@pytest.mark.parametrize("top", [0, 3, MAX_TOP_LOGPROBS])
def test_distribution_per_position(top: int) -> None:
    lp = MockLogprobs(seed=7, vocab_size=1000, special=frozenset({0}), top=top, prompt=None)
    for pos in range(200):
        chosen, alts = lp.position(pos, 42)
        assert len(alts) == top
        values = [a.logprob for a in alts]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 0.99
        assert chosen < 0
        ids = [a.token_id for a in alts]
        assert len(set(ids)) == len(ids) and 0 not in ids
        listed = dict((a.token_id, a.logprob) for a in alts)
        if 42 in listed:
            assert listed[42] == chosen
        elif alts:
            assert chosen < values[-1]  # not listed: less likely than every listed one
        assert lp.position(pos, 42) == (chosen, alts)  # a function of seed and position


def test_the_chosen_token_is_usually_the_most_likely() -> None:
    lp = MockLogprobs(seed=1, vocab_size=32000, special=frozenset(), top=5, prompt=None)
    firsts = sum(lp.position(pos, 7)[1][0].token_id == 7 for pos in range(500))
    assert 200 < firsts < 480


async def test_engine_chunks_carry_aligned_logprobs() -> None:
    outs = await run(asking(4, prompt=4))
    assert outs[0].prompt_logprobs is not None
    assert len(outs[0].prompt_logprobs) == 20 and outs[0].prompt_logprobs[0] is None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 12
    for out in outs:
        if out.token_ids:
            assert out.log_probs is not None and out.top_logprobs is not None
            assert len(out.log_probs) == len(out.top_logprobs) == len(out.token_ids)
            assert all(len(top) == 4 for top in out.top_logprobs)
    # per token, not per chunk: how tokens coalesce into chunks depends on the loop's timing
    again = await run(asking(4, prompt=4))
    assert [lp for o in again for lp in o.log_probs or []] == [
        lp for o in outs for lp in o.log_probs or []
    ]
    other = await run(asking(4, prompt=4, seed=6))
    assert [lp for o in other for lp in o.log_probs or []] != [
        lp for o in outs for lp in o.log_probs or []
    ]


async def test_engine_without_the_ask_sends_none() -> None:
    outs = await run(asking(None))
    assert all(o.log_probs is None and o.top_logprobs is None for o in outs)


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (asking(MAX_TOP_LOGPROBS + 1), "output.logprobs"),
        (
            msgspec.structs.replace(
                make_request(8, 2),
                sampling=SamplingOptions(guided_decoding=GuidedDecodingOptions(regex="a")),
            ),
            "sampling.guided_decoding",
        ),
        (
            msgspec.structs.replace(make_request(8, 2), sampling=SamplingOptions(min_p=0.1)),
            "sampling.min_p",
        ),
        (
            msgspec.structs.replace(
                make_request(8, 2), sampling=SamplingOptions(presence_penalty=0.5)
            ),
            "sampling.presence_penalty",
        ),
    ],
)
async def test_engine_refuses_what_its_card_does_not_advertise(
    request_: PreprocessedRequest, param: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        await run(request_)
    assert info.value.param == param


async def test_the_card_advertises_logprobs() -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=0.0))
    config = await engine.start(1)
    await engine.cleanup()
    assert config.capabilities == CAPABILITIES
    assert CAPABILITIES.logprobs and CAPABILITIES.prompt_logprobs
    assert not (CAPABILITIES.guided_decoding or CAPABILITIES.min_p)
    assert not (CAPABILITIES.presence_penalty or CAPABILITIES.frequency_penalty)
    assert not CAPABILITIES.repetition_penalty

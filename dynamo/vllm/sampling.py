"""Our ``PreprocessedRequest`` as vLLM ``SamplingParams`` keyword arguments (no vLLM import:
the engine builds ``SamplingParams(**kwargs)``; ``structured_outputs`` is a dict the engine turns
into vLLM's ``StructuredOutputsParams``).

Stop strings are the frontend's (its detokenizer applies them), so vLLM gets token ids only and
does not detokenize. Outputs are deltas (``RequestOutputKind.DELTA``, set by the engine).
"""

from __future__ import annotations

from typing import Any

from dynamo.protocol.request import GuidedDecodingOptions, PreprocessedRequest
from dynamo.runtime.errors import InvalidArgument

MAX_LOGPROBS = 20
"""vLLM's default ``max_logprobs``."""


def sampling_kwargs(request: PreprocessedRequest, context_length: int) -> dict[str, Any]:
    """vLLM ``SamplingParams`` arguments; ``InvalidArgument`` for what vLLM would refuse with
    a less clear message (or accept and drop)."""
    s, stop, output = request.sampling, request.stop, request.output
    isl = len(request.token_ids)
    if isl == 0:
        raise InvalidArgument("the prompt is empty")
    room = context_length - isl
    max_tokens = room if stop.max_tokens is None else stop.max_tokens
    if max_tokens < 1:
        raise InvalidArgument("max_tokens must be at least 1")
    if max_tokens > room:
        raise InvalidArgument(
            f"prompt ({isl}) + max_tokens ({max_tokens}) exceeds the context length "
            f"({context_length})"
        )
    kwargs: dict[str, Any] = {
        "n": 1,  # the frontend fans n out into n requests
        "max_tokens": max_tokens,
        "min_tokens": stop.min_tokens or 0,
        "stop_token_ids": list(stop.stop_token_ids),
        "ignore_eos": stop.ignore_eos,
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if s.greedy:
        kwargs["temperature"] = 0.0
    elif s.temperature is not None:
        kwargs["temperature"] = s.temperature
    for name in ("top_p", "min_p", "seed", "repetition_penalty"):
        value = getattr(s, name)
        if value is not None:
            kwargs[name] = value
    if s.top_k is not None:
        kwargs["top_k"] = s.top_k if s.top_k > 0 else 0
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None:
            if not -2.0 <= value <= 2.0:
                raise InvalidArgument(f"{name} must be in [-2, 2]")
            kwargs[name] = value
    for name, value in (("logprobs", output.logprobs), ("prompt_logprobs", output.prompt_logprobs)):
        if value is not None:
            if not 0 <= value <= MAX_LOGPROBS:
                raise InvalidArgument(f"{name} must be in [0, {MAX_LOGPROBS}]")
            kwargs[name] = value
    if s.guided_decoding is not None:
        kwargs["structured_outputs"] = structured_outputs(s.guided_decoding)
    return kwargs


def structured_outputs(options: GuidedDecodingOptions) -> dict[str, Any]:
    """vLLM's ``StructuredOutputsParams`` fields for our one guided-decoding field."""
    if options.json is not None:
        return {"json": options.json}
    if options.json_object:
        return {"json_object": True}
    if options.regex is not None:
        return {"regex": options.regex}
    if options.choice is not None:
        return {"choice": list(options.choice)}
    if options.grammar is not None:
        return {"grammar": options.grammar}
    raise InvalidArgument("guided decoding names no constraint")

"""Which OpenAI and NvExt fields a request may use, given what its model's engine honours.

No field is accepted and silently dropped: a request asking for something the serving engine does
not advertise in its model card (``ModelCard.capabilities``), or something no engine here can do,
is answered 400 with an OpenAI error whose ``param`` names the field. Fields at their neutral
value (``presence_penalty: 0``, ``repetition_penalty: 1``, ``min_p: 0``, ``response_format:
text``, ``tool_choice: auto``...) ask for nothing and always pass: clients send them by default.
"""

from __future__ import annotations

from collections.abc import Iterable

from dynamo.frontend.request_params import (
    SUPPORTED_ANNOTATIONS,
    SUPPORTED_EXTRA_FIELDS,
    guided_decoding,
)
from dynamo.protocol.model_card import EngineCapabilities, ModelCard
from dynamo.protocol.openai import ChatCompletionRequest, CompletionRequest
from dynamo.runtime.errors import InvalidArgument


def serving_capabilities(cards: Iterable[ModelCard]) -> EngineCapabilities | None:
    """What every one of ``cards`` honours (a request may be routed to any of them); None when
    there is no card (the request will fail for want of a worker, not for a field)."""
    caps = [card.capabilities for card in cards]
    if not caps:
        return None
    first = caps[0]
    if all(c == first for c in caps):
        return first
    return EngineCapabilities(
        logprobs=all(c.logprobs for c in caps),
        max_top_logprobs=min(c.max_top_logprobs for c in caps),
        prompt_logprobs=all(c.prompt_logprobs for c in caps),
        min_p=all(c.min_p for c in caps),
        repetition_penalty=all(c.repetition_penalty for c in caps),
        presence_penalty=all(c.presence_penalty for c in caps),
        frequency_penalty=all(c.frequency_penalty for c in caps),
        guided_decoding=all(c.guided_decoding for c in caps),
    )


def check_supported(
    req: ChatCompletionRequest | CompletionRequest, caps: EngineCapabilities | None
) -> None:
    """Raise :class:`InvalidArgument` (HTTP 400, ``param`` = the field) if ``req`` asks for
    something that ``caps`` (the serving engine's capabilities) or this frontend cannot honour.
    ``caps=None`` checks only what does not depend on the engine."""
    _check_frontend_fields(req)
    if caps is None:
        return
    name = "the serving engine"
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs:
            if not caps.logprobs:
                raise _unsupported("logprobs", f"{name} does not return log-probabilities")
            top = req.top_logprobs or 0
            if top > caps.max_top_logprobs:
                raise InvalidArgument(
                    f"top_logprobs {top} exceeds the maximum of {caps.max_top_logprobs} that "
                    f"{name} returns",
                    param="top_logprobs",
                )
    else:
        if req.logprobs is not None:
            if not caps.logprobs:
                raise _unsupported("logprobs", f"{name} does not return log-probabilities")
            if req.logprobs > caps.max_top_logprobs:
                raise InvalidArgument(
                    f"logprobs {req.logprobs} exceeds the maximum of {caps.max_top_logprobs} "
                    f"that {name} returns",
                    param="logprobs",
                )
            if req.echo and not caps.prompt_logprobs:
                raise _unsupported(
                    "echo", f"echo with logprobs needs prompt log-probabilities; {name} has none"
                )
    nv = req.nvext
    if req.min_p and not caps.min_p:
        raise _unsupported("min_p", f"{name} does not implement min_p sampling")
    if req.presence_penalty and not caps.presence_penalty:
        raise _unsupported("presence_penalty", f"{name} does not implement presence_penalty")
    if req.frequency_penalty and not caps.frequency_penalty:
        raise _unsupported("frequency_penalty", f"{name} does not implement frequency_penalty")
    for param, value in (
        ("repetition_penalty", req.repetition_penalty),
        ("nvext.repetition_penalty", nv.repetition_penalty if nv else None),
    ):
        if value is not None and value != 1.0 and not caps.repetition_penalty:
            raise _unsupported(param, f"{name} does not implement repetition_penalty")
    guided = guided_decoding(req)
    if guided is not None and not caps.guided_decoding:
        raise _unsupported(guided[0], f"{name} does not implement guided decoding")


def _check_frontend_fields(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Fields no engine behind this frontend can honour, and NvExt names it does not know."""
    if req.logit_bias:
        raise _unsupported("logit_bias", "no engine here applies a logit bias")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise _unsupported(
            "stream_options", "continuous_usage_stats (usage is sent once, at the end)"
        )
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidArgument("top_logprobs requires logprobs to be true", param="top_logprobs")
        choice = req.tool_choice
        if choice is not None and choice not in ("none", "auto"):
            raise _unsupported(
                "tool_choice",
                "only 'none' and 'auto' are; forcing a tool call needs tool-call parsing",
            )
        if req.functions or req.function_call is not None:
            param = "functions" if req.functions else "function_call"
            raise _unsupported(param, "the deprecated function calling; use tools")
        if req.audio is not None or (req.modalities and req.modalities != ["text"]):
            raise _unsupported(
                "audio" if req.audio is not None else "modalities", "the output is text only"
            )
        if req.parallel_tool_calls is False:
            raise _unsupported(
                "parallel_tool_calls", "false (at most one tool call) cannot be enforced"
            )
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise InvalidArgument(
                "response_format of type json_schema needs a json_schema object",
                param="response_format",
            )
    else:
        if req.suffix:
            raise _unsupported("suffix", "fill-in-the-middle is not implemented")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidArgument(
                f"best_of must equal n ({req.n}): generating extra candidates to rank is "
                "not supported",
                param="best_of",
            )
    for where, body in (("", req), ("nvext.", req.nvext)):
        if body is None:
            continue
        if body.guided_decoding_backend is not None:
            raise _unsupported(
                where + "guided_decoding_backend", "the engine chooses its guided decoding backend"
            )
        if body.guided_whitespace_pattern is not None:
            raise _unsupported(
                where + "guided_whitespace_pattern", "guided decoding takes no whitespace pattern"
            )
    nv = req.nvext
    if nv is None:
        return
    for annotation in nv.annotations or ():
        if annotation not in SUPPORTED_ANNOTATIONS:
            raise InvalidArgument(
                f"unknown nvext.annotations entry {annotation!r}; supported: "
                f"{', '.join(SUPPORTED_ANNOTATIONS)}",
                param="nvext.annotations",
            )
    for extra in nv.extra_fields or ():
        if extra not in SUPPORTED_EXTRA_FIELDS:
            raise InvalidArgument(
                f"unsupported nvext.extra_fields entry {extra!r}; supported: "
                f"{', '.join(SUPPORTED_EXTRA_FIELDS)}",
                param="nvext.extra_fields",
            )


def _unsupported(param: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{param} is not supported: {why}", param=param)

"""The engine side of "no field silently ignored": an engine refuses a request that needs
something it does not advertise in its ``EngineCapabilities`` (the frontend checks the same
before sending, by OpenAI field name; this guards direct callers of the request plane)."""

from __future__ import annotations

from dynamo.protocol.model_card import EngineCapabilities
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.errors import InvalidArgument


def check_request(request: PreprocessedRequest, caps: EngineCapabilities) -> None:
    """Raise InvalidArgument (``param``: the PreprocessedRequest field) if ``request`` needs a
    capability ``caps`` lacks. Neutral values (penalty 0 or 1, min_p 0) need nothing."""
    s = request.sampling
    if s.min_p and not caps.min_p:
        raise _refuse("sampling.min_p")
    if s.presence_penalty and not caps.presence_penalty:
        raise _refuse("sampling.presence_penalty")
    if s.frequency_penalty and not caps.frequency_penalty:
        raise _refuse("sampling.frequency_penalty")
    rep = s.repetition_penalty
    if rep is not None and rep != 1.0 and not caps.repetition_penalty:
        raise _refuse("sampling.repetition_penalty")
    if s.guided_decoding is not None and not caps.guided_decoding:
        raise _refuse("sampling.guided_decoding")
    out = request.output
    if out.logprobs is not None:
        if not caps.logprobs:
            raise _refuse("output.logprobs")
        if out.logprobs > caps.max_top_logprobs:
            raise InvalidArgument(
                f"output.logprobs {out.logprobs} exceeds this engine's maximum of "
                f"{caps.max_top_logprobs}",
                param="output.logprobs",
            )
    if out.prompt_logprobs is not None:
        if not caps.prompt_logprobs:
            raise _refuse("output.prompt_logprobs")
        if out.prompt_logprobs > caps.max_top_logprobs:
            raise InvalidArgument(
                f"output.prompt_logprobs {out.prompt_logprobs} exceeds this engine's maximum "
                f"of {caps.max_top_logprobs}",
                param="output.prompt_logprobs",
            )


def _refuse(param: str) -> InvalidArgument:
    return InvalidArgument(f"{param} is not supported by this engine", param=param)

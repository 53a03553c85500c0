"""Decoding of very large request bodies in a separate process.

msgspec holds the GIL while it decodes: a 40 MB body took 0.1-0.5 s, during which the event loop
of the frontend could not run, whichever thread decoded. Bodies past
``offload.PROCESS_ABOVE_BYTES`` are therefore decoded in a helper process. Most such bodies are
prompts far beyond the context, so the helper also measures the prompt against the model's bound
(``Preprocessor.max_prompt_chars``): a prompt that cannot fit comes back as a small
:class:`TooLong` verdict instead of a 40 MB request the frontend would unpickle only to refuse.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from dynamo.protocol.openai import ChatCompletionRequest, CompletionRequest

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def decode(endpoint: str, body: bytes) -> ChatCompletionRequest | CompletionRequest:
    """The request of ``endpoint`` (``chat_completions`` or ``completions``) in ``body``."""
    if endpoint == "chat_completions":
        return _chat_decoder.decode(body)
    return _completion_decoder.decode(body)


class TooLong(msgspec.Struct, frozen=True):
    """The prompt of ``model`` has ``chars`` characters, more than its bound ``limit``."""

    model: str
    chars: int
    limit: int


def prompt_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    """Characters of prompt text in ``req`` (a lower bound on what the template renders)."""
    if isinstance(req, CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, str):
            return len(prompt)
        return max((len(p) for p in prompt if isinstance(p, str)), default=0)
    size = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            size += len(content)
        elif content is not None:
            size += sum(len(p["text"]) for p in content if isinstance(p.get("text"), str))
    return size


def decode_checked(
    endpoint: str, body: bytes, limits: Mapping[str, int]
) -> ChatCompletionRequest | CompletionRequest | TooLong:
    """Decode ``body`` for ``endpoint``; a prompt over its model's character limit (``limits``:
    served model -> bound) is a :class:`TooLong`. Runs in the helper process."""
    req = decode(endpoint, body)
    limit = limits.get(req.model)
    if limit is not None:
        chars = prompt_chars(req)
        if chars > limit:
            return TooLong(req.model, chars, limit)
    return req

"""OpenAI response shaping: SSE framing of chunks, and folding a stream into a unary response."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import msgspec

from dynamo.frontend.logprobs import ResponseExtras, TokenLogprobs
from dynamo.protocol.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionUsage,
    PromptTokensDetails,
)

_encoder = msgspec.json.Encoder()
encode_json = _encoder.encode

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
    ("x-accel-buffering", "no"),
]
JSON_HEADERS = [("content-type", "application/json")]


def sse(payload: bytes, event: str | None = None) -> bytes:
    if event is None:
        return b"data: " + payload + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + payload + b"\n\n"


def usage(prompt: int, completion: int, cached: int | None) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=None if cached is None else PromptTokensDetails(cached_tokens=cached),
    )


_MARK = "\x00"  # encodes as "\u0000": cannot occur elsewhere in an encoded chunk


def _split_template(encoded: bytes) -> tuple[bytes, bytes]:
    """(prefix, suffix) around the JSON string of the marker text in an encoded chunk."""
    prefix, _, suffix = encoded.partition(encode_json(_MARK))
    return b"data: " + prefix, suffix + b"\n\n"


class _Formatter(ABC):
    """Shared shaping for one request (one id, one model, one ``created``).

    Text deltas, the per-token hot path, are the request's pre-rendered chunk with only the text
    encoded per token: byte-identical to encoding the whole chunk. Subclasses say how a chunk, a
    choice and the unary response look.
    """

    def __init__(
        self, request_id: str, model: str, created: int, extras: ResponseExtras | None = None
    ) -> None:
        self.id = request_id
        self.model = model
        self.created = created
        self._templates: dict[int, tuple[bytes, bytes]] = {}
        # logprobs / echo (frontend/logprobs.py): when set, every text chunk is rendered whole
        self.extras = extras

    # -- what differs per API ---------------------------------------------------------------
    chunk_type: type[ChatCompletionChunk] | type[CompletionChunk]

    def _chunk(
        self,
        choices: list[Any],
        *,
        usage: CompletionUsage | None = None,
        nvext: dict[str, object] | None = None,
    ) -> ChatCompletionChunk | CompletionChunk:
        return self.chunk_type(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            nvext=nvext,
        )

    @abstractmethod
    def _text_choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: TokenLogprobs | None = None,
    ) -> Any: ...

    @abstractmethod
    def _response(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        logprobs: list[TokenLogprobs | None],
    ) -> list[Any]: ...

    def role_chunk(self, index: int) -> bytes | None:
        """The first chunk of a choice (chat: the assistant role), or None."""
        return None

    # -- shared ---------------------------------------------------------------------------------
    def text_chunk(self, index: int, text: str) -> bytes:
        template = self._templates.get(index)
        if template is None:
            marked = self._text_choice(index, _MARK, None)
            template = self._templates[index] = _split_template(encode_json(self._chunk([marked])))
        return template[0] + encode_json(text) + template[1]

    def delta_chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: TokenLogprobs | None = None,
    ) -> bytes:
        if finish_reason is None and text and self.extras is None:
            return self.text_chunk(index, text)
        choice = self._text_choice(index, text, finish_reason, logprobs)
        return sse(encode_json(self._chunk([choice])))

    def extra_chunk(self, nvext: dict[str, object], event: str | None = None) -> bytes:
        return sse(encode_json(self._chunk([], nvext=nvext)), event)

    def usage_chunk(self, u: CompletionUsage) -> bytes:
        return sse(encode_json(self._chunk([], usage=u)))

    def response(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        u: CompletionUsage,
        nvext: dict[str, object] | None,
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> bytes:
        """The unary body; ``logprobs``: each choice's, folded (``TokenLogprobs.concat``)."""
        lps: list[TokenLogprobs | None] = [None] * len(texts) if logprobs is None else logprobs
        return encode_json(self._unary(self._response(texts, finish_reasons, lps), u, nvext))

    @abstractmethod
    def _unary(
        self, choices: list[Any], u: CompletionUsage, nvext: dict[str, object] | None
    ) -> msgspec.Struct: ...


class ChatFormatter(_Formatter):
    """chat.completion.chunk / chat.completion."""

    chunk_type = ChatCompletionChunk

    def _text_choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: TokenLogprobs | None = None,
    ) -> ChatChunkChoice:
        delta = ChatDelta(content=text) if text else ChatDelta()
        lp = None if self.extras is None else self.extras.chat(logprobs)
        return ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=lp)

    def role_chunk(self, index: int) -> bytes:
        choice = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        return sse(encode_json(self._chunk([choice])))

    def _response(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        logprobs: list[TokenLogprobs | None],
    ) -> list[Any]:
        extras = self.extras
        return [
            ChatChoice(
                index=i,
                message=ChatResponseMessage(role="assistant", content=texts[i]),
                finish_reason=finish_reasons[i],
                logprobs=None if extras is None else extras.chat(logprobs[i]),
            )
            for i in range(len(texts))
        ]

    def _unary(
        self, choices: list[Any], u: CompletionUsage, nvext: dict[str, object] | None
    ) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=u,
            nvext=nvext,
        )


class CompletionFormatter(_Formatter):
    """text_completion chunks and response (one struct for both)."""

    chunk_type = CompletionChunk

    def _text_choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: TokenLogprobs | None = None,
    ) -> CompletionChoice:
        lp = None
        if self.extras is not None:
            text, lp = self.extras.completion(index, text, logprobs)
        return CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=lp)

    def delta_chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: TokenLogprobs | None = None,
    ) -> bytes:
        if finish_reason is None and self.extras is None:  # an empty text delta is a chunk too
            return self.text_chunk(index, text)
        return super().delta_chunk(index, text, finish_reason, logprobs)

    def _response(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        logprobs: list[TokenLogprobs | None],
    ) -> list[Any]:
        return [
            self._text_choice(i, texts[i], finish_reasons[i], logprobs[i])
            for i in range(len(texts))
        ]

    def _unary(
        self, choices: list[Any], u: CompletionUsage, nvext: dict[str, object] | None
    ) -> msgspec.Struct:
        return self._chunk(choices, usage=u, nvext=nvext)


Formatter = ChatFormatter | CompletionFormatter

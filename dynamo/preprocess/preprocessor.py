"""``Preprocessor``: OpenAI-style inputs (chat messages or completion prompts) -> tokenized
:class:`PreprocessedRequest` with clamped limits, plus the matching output detokenizer.

It knows nothing about HTTP: the frontend parses the body and passes plain values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynamo.preprocess.chat_template import Message
from dynamo.preprocess.detokenizer import IncrementalDetokenizer
from dynamo.preprocess.model_dir import ModelDir
from dynamo.preprocess.tokenizer import Tokenizer
from dynamo.protocol.request import (
    GuidedDecodingOptions,
    OutputOptions,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)
from dynamo.runtime.errors import InvalidArgument

CompletionPrompt = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


@dataclass(frozen=True, slots=True)
class PromptText:
    """A prompt's text before tokenization, and whether the tokenizer adds its special tokens
    (e.g. BOS: yes for a completion prompt, no for a rendered chat template, which has them)."""

    text: str
    add_special_tokens: bool


Prompt = PromptText | list[int]
"""A prompt to serve: text to tokenize, or token ids the client sent (already checked)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationParams:
    """A request's sampling and stop fields, already merged from the body's top level and nvext.

    ``max_tokens`` is ``max_completion_tokens`` if given, else ``max_tokens``; None means "the
    rest of the context". ``stop`` is OpenAI's ``stop`` (a string or a list of strings).
    """

    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    guided_decoding: GuidedDecodingOptions | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    greedy: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    annotations: Sequence[str] = ()
    request_id: str | None = None
    routing: RoutingHints | None = None


@dataclass(slots=True)
class Prepared:
    """One engine request plus what the frontend needs beside it.

    ``formatted_prompt`` is the prompt text that was tokenized (the rendered chat template, or
    the completion prompt); None when the client sent token ids. ``stop`` holds the stop strings
    (applied by the detokenizer, not sent to the engine).
    """

    request: PreprocessedRequest
    formatted_prompt: str | None
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.token_ids)


class Preprocessor:
    """Per-model preprocessing; stateless per request, so one instance serves all requests.

    ``context_length`` overrides the model directory's (e.g. the worker's registered value).
    """

    def __init__(
        self, model: ModelDir, *, served_model_name: str, context_length: int | None = None
    ) -> None:
        self._model = model
        self._tokenizer = model.tokenizer
        self._name = served_model_name
        self._context_length = context_length or model.context_length
        self._eos_token_ids = list(model.eos_token_ids)

    @property
    def model(self) -> ModelDir:
        return self._model

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def context_length(self) -> int:
        return self._context_length

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat prompt text. ``add_generation_prompt=None`` means: add the assistant header
        unless the last message is the assistant's (or ``continue_final_message`` is set).
        ``chat_template_kwargs`` become template variables and, as in vLLM, may override the
        named options (e.g. ``add_generation_prompt``)."""
        template = self._model.chat_template
        if template is None:
            raise InvalidArgument("this model has no chat template; use /v1/completions")
        if add_generation_prompt is None:
            last_role = _as_dict(messages[-1]).get("role") if messages else None
            add_generation_prompt = not continue_final_message and last_role != "assistant"
        options: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "continue_final_message": continue_final_message,
        }
        options.update(chat_template_kwargs or {})
        if "messages" in options:
            raise InvalidArgument("chat_template_kwargs must not contain 'messages'")
        return template.render(messages, **options)

    def chat_prompt(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_raw_prompt: bool = False,
    ) -> PromptText:
        """A chat completion's prompt text, checked and rendered but not yet tokenized.

        The chat template renders the messages and the result is tokenized without adding
        special tokens (the template has them), like ``apply_chat_template(tokenize=True)``.
        ``use_raw_prompt`` (nvext) skips the template: the text contents of all messages,
        concatenated in order with nothing between them, are tokenized like a completion prompt
        (with the tokenizer's special tokens, e.g. BOS). Raises InvalidArgument (HTTP 400).
        """
        if not messages:
            raise InvalidArgument("messages must contain at least one message")
        messages = _checked_messages(messages)
        if use_raw_prompt:
            text = "".join(_message_text(_as_dict(message)) for message in messages)
            return self._prompt_text(text, add_special_tokens=True)
        text = self.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self._prompt_text(text, add_special_tokens=False)

    def completion_prompts(
        self, prompt: CompletionPrompt, *, add_special_tokens: bool = True
    ) -> list[Prompt]:
        """A (legacy) completion's prompts, checked but not yet tokenized: one per prompt of
        the batch.

        ``prompt`` is a string, a list of token ids, a list of strings or a list of token-id
        lists. Text is tokenized as is (no chat template, so nvext ``use_raw_prompt`` changes
        nothing here) with the tokenizer's special tokens (e.g. BOS), as vLLM does; token ids are
        passed through after a range check.
        """
        if isinstance(prompt, str):
            return [self._prompt_text(prompt, add_special_tokens)]
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes) or not prompt:
            raise InvalidArgument("prompt must be a non-empty string, token list or batch")
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return [self._checked_ids(prompt)]
        batch: list[Prompt] = []
        for item in prompt:
            if isinstance(item, str):
                batch.append(self._prompt_text(item, add_special_tokens))
            elif isinstance(item, Sequence) and not isinstance(item, bytes):
                batch.append(self._checked_ids(item))
            else:
                raise InvalidArgument("a prompt batch must hold only strings or only token lists")
        if len({type(p) for p in batch}) > 1:
            raise InvalidArgument("a prompt batch must hold only strings or only token lists")
        return batch

    def encode(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """The token ids of every prompt, tokenized here and now (``frontend/offload.py`` has
        the same off the event loop)."""
        return [
            p if isinstance(p, list) else self._tokenizer.encode(p.text, p.add_special_tokens)
            for p in prompts
        ]

    def prepare(
        self, prompts: Sequence[Prompt], token_ids: Sequence[list[int]], params: GenerationParams
    ) -> list[Prepared]:
        """One engine request per prompt, ``token_ids[i]`` being ``prompts[i]``'s tokens.
        Checks the lengths against the context; raises InvalidArgument (HTTP 400)."""
        return [
            self._prepare(ids, p.text if isinstance(p, PromptText) else None, params)
            for p, ids in zip(prompts, token_ids, strict=True)
        ]

    def chat(
        self,
        messages: Sequence[Message],
        params: GenerationParams,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_raw_prompt: bool = False,
    ) -> Prepared:
        """Preprocess a chat completion (:meth:`chat_prompt`, tokenized inline)."""
        prompt = self.chat_prompt(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            use_raw_prompt=use_raw_prompt,
        )
        return self.prepare([prompt], self.encode([prompt]), params)[0]

    def completion(
        self, prompt: CompletionPrompt, params: GenerationParams, *, add_special_tokens: bool = True
    ) -> list[Prepared]:
        """Preprocess a (legacy) completion (:meth:`completion_prompts`, tokenized inline)."""
        prompts = self.completion_prompts(prompt, add_special_tokens=add_special_tokens)
        return self.prepare(prompts, self.encode(prompts), params)

    def detokenizer(self, prepared: Prepared) -> IncrementalDetokenizer:
        """A fresh detokenizer for one choice of ``prepared`` (one per choice when n > 1)."""
        stop = prepared.request.stop
        return IncrementalDetokenizer(
            self._tokenizer,
            stop=prepared.stop,
            stop_token_ids=stop.stop_token_ids,
            eos_token_ids=prepared.request.eos_token_ids,
            ignore_eos=stop.ignore_eos,
            min_tokens=stop.min_tokens or 0,
            skip_special_tokens=prepared.skip_special_tokens,
        )

    def _prompt_text(self, text: str, add_special_tokens: bool) -> PromptText:
        self._check_text_length(text)
        return PromptText(text, add_special_tokens)

    @property
    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt that fits the context can have (context x the most
        characters one token covers), or None when the tokenizer does not bound it."""
        per_token = self._tokenizer.max_token_chars
        return None if per_token is None else self._context_length * per_token

    def _check_text_length(self, text: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit the context: it has at least
        ``len(text) / max_token_chars`` tokens. A 40 MB prompt is refused in microseconds
        instead of being tokenized (seconds of CPU, gigabytes of encodings) to learn the same."""
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            per_token = self._tokenizer.max_token_chars or 1
            least = -(-len(text) // per_token)
            raise InvalidArgument(
                f"this model's maximum context length is {self._context_length} tokens, but the "
                f"prompt has at least {least} tokens ({len(text)} characters); shorten the prompt"
            )

    def _checked_ids(self, ids: Sequence[Any]) -> list[int]:
        limit = self._model.vocab_size
        for token_id in ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise InvalidArgument("a token-id prompt must hold only integers")
            if not 0 <= token_id < limit:
                raise InvalidArgument(f"token id {token_id} is out of vocabulary [0, {limit})")
        return list(ids)

    def _prepare(
        self, token_ids: list[int], text: str | None, params: GenerationParams
    ) -> Prepared:
        num_prompt = len(token_ids)
        if num_prompt == 0:
            raise InvalidArgument("the prompt is empty")
        context = self._context_length
        if num_prompt >= context:
            raise InvalidArgument(
                f"this model's maximum context length is {context} tokens, but the prompt has "
                f"{num_prompt} tokens; shorten the prompt"
            )
        room = context - num_prompt
        max_tokens = params.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise InvalidArgument("max_tokens must be at least 1")
        min_tokens = params.min_tokens
        if min_tokens is not None:
            if min_tokens < 0:
                raise InvalidArgument("min_tokens must be at least 0")
            if max_tokens is not None and min_tokens > max_tokens:
                raise InvalidArgument("min_tokens must not exceed max_tokens")
        if params.n < 1:
            raise InvalidArgument("n must be at least 1")
        if max_tokens is None:
            max_tokens = room
            if min_tokens is not None:
                min_tokens = min(min_tokens, max_tokens)
        elif max_tokens > room:  # refused, not clamped (as vLLM does): the client asked for it
            raise InvalidArgument(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {context} tokens and your request has "
                f"{num_prompt} input tokens ({max_tokens} > {context} - {num_prompt})"
            )
        stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or ())
        request = PreprocessedRequest(
            model=self._name,
            token_ids=token_ids,
            request_id=params.request_id,
            sampling=SamplingOptions(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
                repetition_penalty=params.repetition_penalty,
                min_p=params.min_p,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                guided_decoding=params.guided_decoding,
                greedy=params.greedy,
                n=params.n,
            ),
            output=OutputOptions(logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs),
            stop=StopConditions(
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=params.ignore_eos,
            ),
            eos_token_ids=list(self._eos_token_ids),
            routing=params.routing,
            annotations=list(params.annotations),
        )
        return Prepared(
            request=request,
            formatted_prompt=text,
            stop=[s for s in stop if s],
            skip_special_tokens=params.skip_special_tokens,
        )


_NEED_CONTENT = frozenset(("system", "developer", "user", "tool"))


def _checked_messages(messages: Sequence[Message]) -> list[Mapping[str, Any]]:
    """OpenAI's message rules: a system, developer, user or tool message has ``content`` (an
    assistant message may have tool calls instead). ``developer`` is OpenAI's newer name for
    ``system`` and is rendered as ``system``, as OpenAI does for models that lack the role.
    Returns new mappings; the caller's are not modified."""
    out: list[Mapping[str, Any]] = []
    for i, message in enumerate(messages):
        m = _as_dict(message)
        role = m.get("role")
        if role in _NEED_CONTENT and m.get("content") is None:
            raise InvalidArgument(f"messages[{i}]: a '{role}' message must have 'content'")
        if role == "developer":
            m = {**m, "role": "system"}
        out.append(m)
    return out


def _as_dict(message: Message) -> Mapping[str, Any]:
    if isinstance(message, msgspec.Struct):
        converted: dict[str, Any] = msgspec.to_builtins(message)
        return converted
    if not isinstance(message, Mapping):
        raise InvalidArgument("a chat message must be an object")
    return message


def _message_text(message: Mapping[str, Any]) -> str:
    """A message's text: its string content, or its text parts joined."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "".join(texts)
    raise InvalidArgument("message content must be a string or a list of parts")

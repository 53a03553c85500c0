"""OpenAI-compatible HTTP wire types (spec 004), with the NVIDIA extension ``nvext``.

Requests are decoded with validation (ranges via ``msgspec.Meta``); unknown top-level fields are
ignored, as OpenAI clients send many optional ones, but every field that would change the answer
is declared here, so that the frontend either honours it or refuses it by name
(``frontend/capabilities.py``); unknown ``nvext`` keys are a 400. Sampling fields that vLLM and
aiperf send at the top level (top_k, repetition_penalty, min_tokens, ignore_eos, ...) are accepted
there as well as in nvext.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(ge=0.0, le=1.0)]
# Every integer is bounded: msgpack (the request plane) and the engines take 64-bit values at
# most, so a 65-bit integer must be a 400 here, not an OverflowError (a 500) further on.
_I64_MAX = (1 << 63) - 1
_U32_MAX = (1 << 32) - 1
PositiveInt = Annotated[int, Meta(ge=1, le=_I64_MAX)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=_I64_MAX)]
Seed = Annotated[int, Meta(ge=-(1 << 63), le=_I64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=_U32_MAX)]
InstanceId = Annotated[int, Meta(ge=0, le=_I64_MAX)]
DpRank = Annotated[int, Meta(ge=0, le=_U32_MAX)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]


TopK = Annotated[int, Meta(ge=-1, le=_U32_MAX)]  # -1 (or None): no limit


PriorityJump = Annotated[float, Meta(ge=0.0, le=1e9)]
StrictPriority = Annotated[int, Meta(ge=0, le=_U32_MAX)]


class AgentHints(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """``nvext.agent_hints``: the request's place in the router queue (FACTS §4.5).
    ``priority`` moves it ahead (fcfs: as if it arrived that many seconds earlier; wspt: its
    weight is ``1 + priority``); ``strict_priority`` is a tier, a higher one always first. Also
    given by the ``x-dynamo-request-priority`` / ``x-dynamo-request-strict-priority`` headers
    (the body wins when both are given)."""

    priority: PriorityJump | None = None
    strict_priority: StrictPriority | None = None


class NvExt(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """NVIDIA's extension. Unlike the OpenAI fields, an unknown key here is a 400: it is our
    own namespace, so a key we do not know asks for something we would silently not do."""

    ignore_eos: bool | None = None
    top_k: TopK | None = None
    repetition_penalty: RepetitionPenalty | None = None
    greedy_sampling: bool | None = None
    greed_sampling: bool | None = None
    use_raw_prompt: bool | None = None
    annotations: list[str] | None = None
    backend_instance_id: InstanceId | None = None
    dp_rank: DpRank | None = None
    extra_fields: list[str] | None = None
    min_tokens: NonNegativeInt | None = None
    agent_hints: AgentHints | None = None
    # Guided decoding (the reference's CommonExt names; also accepted at the top level).
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class StreamOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk (refused)


class ChatMessage(msgspec.Struct, omit_defaults=True, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _SamplingFields(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Fields shared by chat and completions requests."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    nvext: NvExt | None = None
    # vLLM / aiperf style top-level extensions
    top_k: TopK | None = None
    min_p: TopP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: NonNegativeInt | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    logit_bias: dict[str, float] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class ResponseFormat(msgspec.Struct, omit_defaults=True, kw_only=True):
    """``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``
    (``json_schema.schema`` is the JSON schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # deprecated form of tools: refused
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``prompt`` is a string, a list of token ids, or a batch (list of strings or of token-id
    lists); :func:`normalize_prompt` checks the shape (msgspec unions allow one array type)."""

    prompt: str | list[str | TokenId | list[TokenId]]
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1, le=128)] | None = None


def normalize_prompt(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """The batch of prompts: each a string or a token-id list. Raises ValueError on a bad shape."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    if all(isinstance(p, str) for p in prompt):
        return [p for p in prompt if isinstance(p, str)]
    if all(isinstance(p, list) for p in prompt):
        return [p for p in prompt if isinstance(p, list)]
    raise ValueError("prompt must be a string, a list of token ids, or a list of either")


# ---------------------------------------------------------------------------------------------
# responses


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class CompletionUsage(msgspec.Struct, omit_defaults=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True, kw_only=True):
    role: str | None = None
    content: str | None = None


class TopLogprobEntry(msgspec.Struct, kw_only=True):
    """OpenAI chat: one alternative at a position."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(msgspec.Struct, kw_only=True):
    """OpenAI chat: one generated token, its log-probability and its top alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """OpenAI chat ``choices[].logprobs``."""

    content: list[TokenLogprobEntry] | None
    refusal: list[TokenLogprobEntry] | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """OpenAI (legacy) completions ``choices[].logprobs``: parallel lists, one entry per token.
    ``text_offset`` is each token's character offset in the choice's text (echoed prompt
    included); the first prompt token has no log-probability (``None``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(
    msgspec.Struct,
    omit_defaults=True,
    kw_only=True,
    tag_field="object",
    tag="chat.completion.chunk",
):
    """``object`` is the struct's tag, so it is always encoded (omit_defaults would drop it)."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
    nvext: dict[str, Any] | None = None


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(
    msgspec.Struct, omit_defaults=True, kw_only=True, tag_field="object", tag="chat.completion"
):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    nvext: dict[str, Any] | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionChunk(
    msgspec.Struct, omit_defaults=True, kw_only=True, tag_field="object", tag="text_completion"
):
    """Both a streamed chunk and the unary response (OpenAI: ``object="text_completion"``)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
    nvext: dict[str, Any] | None = None


class ModelListing(msgspec.Struct, kw_only=True):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "nvidia"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelListing]
    object: str = "list"


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorDetail

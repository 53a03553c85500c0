"""The preprocessed request: what the frontend sends to a worker after tokenization."""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo.protocol.disagg import DisaggregatedParams


class GuidedDecodingOptions(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """Constrained decoding (spec 000, request side): exactly one field is set.

    ``json`` is a JSON schema (``response_format: json_schema`` or ``nvext.guided_json``);
    ``json_object`` asks for any JSON object (``response_format: json_object``); ``regex``,
    ``choice`` and ``grammar`` (EBNF, as xgrammar/llguidance read it) come from ``nvext``.
    An engine that cannot honour it must not advertise ``guided_decoding`` in its card.
    """

    json: Any | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters. ``None`` means "engine default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    greedy: bool = False
    n: int = 1
    guided_decoding: GuidedDecodingOptions | None = None


class OutputOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What the engine returns beside tokens.

    ``logprobs``: when set, every chunk carries the log-probability of each generated token and
    the ``logprobs`` most likely alternatives (0 = only the chosen token's). ``prompt_logprobs``
    likewise for the prompt tokens (needed by completions ``echo`` with ``logprobs``).
    """

    logprobs: int | None = None
    prompt_logprobs: int | None = None


class StopConditions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """When generation ends. Stop *strings* are applied by the frontend's detokenizer;
    stop token ids and EOS are applied by the engine (``ignore_eos`` disables EOS)."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False


class RoutingHints(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Explicit placement: a worker instance, a DP rank, or a prefill worker (disaggregation);
    and the request's place in the router queue (FACTS §4.5): ``priority_jump`` (seconds of
    earlier arrival under fcfs, a weight under wspt) and ``strict_priority`` (a higher tier is
    always served first)."""

    backend_instance_id: int | None = None
    dp_rank: int | None = None
    prefill_worker_id: int | None = None
    prefill_dp_rank: int | None = None
    priority_jump: float = 0.0
    strict_priority: int = 0


class TraceLink(msgspec.Struct, frozen=True, kw_only=True):
    """A link to the span of a predecessor attempt (prefill -> decode, or a migration retry)."""

    trace_id: str
    span_id: str


class PreprocessedRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A tokenized request, ready for an engine.

    ``prefill_result`` is set on decode-bound requests in disaggregated serving: it carries the
    prefill worker's handoff. ``migration_link`` is set by the framework when the request is a
    continuation of an earlier attempt (its ``engine.generate`` span links to that attempt's).
    """

    model: str
    token_ids: list[int]
    request_id: str | None = None
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stop: StopConditions = msgspec.field(default_factory=StopConditions)
    output: OutputOptions = msgspec.field(default_factory=OutputOptions)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    routing: RoutingHints | None = None
    annotations: list[str] = msgspec.field(default_factory=list)
    lora_name: str | None = None
    prefill_result: DisaggregatedParams | None = None
    migration_link: TraceLink | None = None
    # The W3C ``traceparent`` of the span the request was sent from (the frontend's request
    # span): the worker's spans join that trace (observability/tracing.py).
    traceparent: str | None = None

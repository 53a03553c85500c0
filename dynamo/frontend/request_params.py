"""From an OpenAI request to engine requests: sampling and stop fields (top level or nvext),
guided decoding (``response_format``, ``guided_*``), log-probabilities (``logprobs``,
``top_logprobs``, ``echo``), routing hints, annotations, n choices and prompt batches. Whether
the serving engine can honour them is ``capabilities.check_supported``'s question."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import msgspec

from dynamo.frontend.priority import PriorityHeaders, request_priority
from dynamo.preprocess import GenerationParams, Prepared, Preprocessor, Prompt
from dynamo.protocol.openai import ChatCompletionRequest, CompletionRequest, normalize_prompt
from dynamo.protocol.request import GuidedDecodingOptions, RoutingHints
from dynamo.runtime.errors import InvalidArgument

SUPPORTED_ANNOTATIONS = ("request_id", "formatted_prompt", "token_ids", "timing")
SUPPORTED_EXTRA_FIELDS = ("worker_id", "timing")
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_guided_values = attrgetter(*_GUIDED_FIELDS)  # one C call for the common "none set" case
_NO_GUIDED = (None,) * len(_GUIDED_FIELDS)
MAX_ENGINE_REQUESTS = 1024
"""Most engine requests (prompts of a batch x n) one HTTP request may fan out to."""


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One HTTP request checked and its prompts rendered, before tokenization: the merged
    generation parameters, the prompts (one per prompt of a batch) and ``n``."""

    params: GenerationParams
    prompts: list[Prompt]
    n: int

    def prepared(self, pre: Preprocessor, token_ids: Sequence[list[int]]) -> list[Prepared]:
        """The engine requests, ``token_ids[i]`` being ``prompts[i]``'s tokens: one per choice
        (n) and prompt (batch). Raises InvalidArgument (HTTP 400)."""
        return _expand_n(pre.prepare(self.prompts, token_ids, self.params), self.n)


def prepare_request(
    pre: Preprocessor,
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    priority_headers: PriorityHeaders = (None, None),
) -> list[Prepared]:
    """The engine requests of one HTTP request (:func:`plan_request`, tokenized inline)."""
    plan = plan_request(pre, req, request_id, priority_headers)
    return plan.prepared(pre, pre.encode(plan.prompts))


def plan_request(
    pre: Preprocessor,
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    priority_headers: PriorityHeaders = (None, None),
) -> RequestPlan:
    """One HTTP request's plan: the body's fields merged with nvext (nvext wins for sampling
    extensions), its prompts checked and rendered (chat template). ``priority_headers``: the
    request's router-queue priority headers (``priority.py``). Raises InvalidArgument."""
    nv = req.nvext
    annotations = [a for a in (nv.annotations or []) if a in SUPPORTED_ANNOTATIONS] if nv else []
    routing = None
    jump, strict = (
        request_priority(nv, priority_headers)
        if nv is not None or priority_headers != (None, None)
        else (0.0, 0)
    )
    if (
        nv is not None
        and (nv.backend_instance_id is not None or nv.dp_rank is not None)
        or (jump or strict)
    ):
        routing = RoutingHints(
            backend_instance_id=nv.backend_instance_id if nv is not None else None,
            dp_rank=nv.dp_rank if nv is not None else None,
            priority_jump=jump,
            strict_priority=strict,
        )
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if isinstance(req, CompletionRequest) and max_tokens is None:
        max_tokens = 16  # OpenAI's default for the legacy completions API
    greedy = bool(nv and (nv.greedy_sampling or nv.greed_sampling))
    stop_ids = list(req.stop_token_ids or [])
    guided = guided_decoding(req)
    logprobs, prompt_logprobs = output_logprobs(req)
    params = GenerationParams(
        max_tokens=max_tokens,
        min_tokens=_first(req.min_tokens, nv.min_tokens if nv else None),
        stop=req.stop,
        stop_token_ids=stop_ids,
        ignore_eos=bool(_first(nv.ignore_eos if nv else None, req.ignore_eos)),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=_first(nv.top_k if nv else None, req.top_k),
        seed=req.seed,
        repetition_penalty=_first(nv.repetition_penalty if nv else None, req.repetition_penalty),
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        guided_decoding=None if guided is None else guided[1],
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        greedy=greedy,
        n=req.n,
        annotations=annotations,
        request_id=request_id,
        routing=routing,
    )
    if isinstance(req, ChatCompletionRequest):
        messages = msgspec.to_builtins(req.messages)
        prompt = pre.chat_prompt(
            messages,
            tools=req.tools,
            add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=req.chat_template_kwargs,
            use_raw_prompt=bool(nv and nv.use_raw_prompt),
        )
        return RequestPlan(params, [prompt], req.n)
    try:
        prompts = normalize_prompt(req.prompt)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    if len(prompts) * req.n > MAX_ENGINE_REQUESTS:
        raise InvalidArgument(
            f"a request may hold at most {MAX_ENGINE_REQUESTS} prompts x n; "
            f"this one has {len(prompts)} x {req.n}",
            param="prompt",
        )
    batch: Any = prompts if len(prompts) > 1 else prompts[0]
    return RequestPlan(params, pre.completion_prompts(batch), req.n)


def wants(req: Any, annotation: str) -> bool:
    nv = req.nvext
    return bool(nv is not None and nv.annotations and annotation in nv.annotations)


def wants_timing(req: Any) -> bool:
    """nvext ``timing``: asked as an annotation (spec 004) or an extra field (FACTS §10)."""
    nv = req.nvext
    return wants(req, "timing") or bool(nv and nv.extra_fields and "timing" in nv.extra_fields)


def output_logprobs(
    req: ChatCompletionRequest | CompletionRequest,
) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) for the engine's ``OutputOptions``: chat ``logprobs: true``
    with ``top_logprobs`` alternatives; completions ``logprobs: k`` and, with ``echo``, the
    prompt's log-probabilities too."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0, None) if req.logprobs else (None, None)
    if req.logprobs is None:
        return None, None
    return req.logprobs, (req.logprobs if req.echo else None)


def guided_decoding(
    req: ChatCompletionRequest | CompletionRequest,
) -> tuple[str, GuidedDecodingOptions] | None:
    """The request's one guided-decoding constraint and the field that asked for it (chat
    ``response_format``, or ``guided_json|regex|choice|grammar`` at the top level or in nvext),
    or None. Raises InvalidArgument when more than one is given or one is malformed."""
    found: list[tuple[str, GuidedDecodingOptions]] = []
    if isinstance(req, ChatCompletionRequest) and req.response_format is not None:
        fmt = req.response_format
        if fmt.type == "json_object":
            found.append(("response_format", GuidedDecodingOptions(json_object=True)))
        elif fmt.type == "json_schema":
            spec = fmt.json_schema or {}
            schema = spec.get("schema")
            options = (
                GuidedDecodingOptions(json_object=True)
                if schema is None
                else GuidedDecodingOptions(json=schema)
            )
            found.append(("response_format", options))
    for prefix, body in (("", req), ("nvext.", req.nvext)):
        if body is None:
            continue
        values = _guided_values(body)
        if values == _NO_GUIDED:
            continue
        for name, value in zip(_GUIDED_FIELDS, values, strict=True):
            if value is not None:
                found.append((prefix + name, _guided_option(prefix + name, name, value)))
    if len(found) > 1:
        raise InvalidArgument(
            f"only one guided-decoding constraint may be given; got {found[0][0]} and "
            f"{found[1][0]}",
            param=found[1][0],
        )
    return found[0] if found else None


def _guided_option(param: str, name: str, value: Any) -> GuidedDecodingOptions:
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = msgspec.json.decode(value)
            except msgspec.DecodeError as exc:
                raise InvalidArgument(f"{param} is not valid JSON: {exc}", param=param) from exc
        if not isinstance(value, dict | bool):
            raise InvalidArgument(f"{param} must be a JSON schema (an object)", param=param)
        return GuidedDecodingOptions(json=value)
    if name == "guided_choice":
        if not value:
            raise InvalidArgument(f"{param} must list at least one choice", param=param)
        return GuidedDecodingOptions(choice=list(value))
    if not value:
        raise InvalidArgument(f"{param} must not be empty", param=param)
    if name == "guided_regex":
        return GuidedDecodingOptions(regex=value)
    return GuidedDecodingOptions(grammar=value)


def _first(*values: Any) -> Any:
    for value in values:
        if value is not None:
            return value
    return None


def _expand_n(base: list[Prepared], n: int) -> list[Prepared]:
    """n choices per prompt (OpenAI order: prompt-major); each its own engine request."""
    if n == 1:
        return base
    out: list[Prepared] = []
    for prompt_idx, p in enumerate(base):
        for i in range(n):
            req = msgspec.structs.replace(
                p.request,
                request_id=f"{p.request.request_id}-{prompt_idx * n + i}",
                sampling=msgspec.structs.replace(
                    p.request.sampling,
                    seed=None if p.request.sampling.seed is None else p.request.sampling.seed + i,
                ),
            )
            out.append(Prepared(req, p.formatted_prompt, list(p.stop), p.skip_special_tokens))
    return out

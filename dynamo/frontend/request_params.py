"""From an OpenAI request to engine requests: sampling and stop fields (top level or nvext),
routing hints, annotations, n choices and prompt batches."""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo.preprocess import GenerationParams, Prepared, Preprocessor
from dynamo.protocol.openai import ChatCompletionRequest, CompletionRequest, normalize_prompt
from dynamo.protocol.request import RoutingHints
from dynamo.runtime.errors import InvalidArgument

SUPPORTED_ANNOTATIONS = ("request_id", "formatted_prompt", "token_ids")


def prepare_request(
    pre: Preprocessor, req: ChatCompletionRequest | CompletionRequest, request_id: str
) -> list[Prepared]:
    """The engine requests of one HTTP request: the body's fields merged with nvext (nvext
    wins for sampling extensions), preprocessed, one per choice (n) and prompt (batch)."""
    nv = req.nvext
    annotations = [a for a in (nv.annotations or []) if a in SUPPORTED_ANNOTATIONS] if nv else []
    routing = None
    if nv is not None and (nv.backend_instance_id is not None or nv.dp_rank is not None):
        routing = RoutingHints(backend_instance_id=nv.backend_instance_id, dp_rank=nv.dp_rank)
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if isinstance(req, CompletionRequest) and max_tokens is None:
        max_tokens = 16  # OpenAI's default for the legacy completions API
    greedy = bool(nv and (nv.greedy_sampling or nv.greed_sampling))
    stop_ids = list(req.stop_token_ids or [])
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
        greedy=greedy,
        n=req.n,
        annotations=annotations,
        request_id=request_id,
        routing=routing,
    )
    if isinstance(req, ChatCompletionRequest):
        messages = msgspec.to_builtins(req.messages)
        base = [
            pre.chat(
                messages,
                params,
                tools=req.tools,
                add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
                use_raw_prompt=bool(nv and nv.use_raw_prompt),
            )
        ]
    else:
        try:
            prompts = normalize_prompt(req.prompt)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        batch: Any = prompts if len(prompts) > 1 else prompts[0]
        base = pre.completion(batch, params)
    return _expand_n(base, req.n)


def wants(req: Any, annotation: str) -> bool:
    nv = req.nvext
    return bool(nv is not None and nv.annotations and annotation in nv.annotations)


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

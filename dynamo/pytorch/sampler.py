"""Sampling for a batch of rows: penalties, the guided-decoding seam, greedy or seeded random
sampling (temperature, top_k, top_p, min_p) and log-probabilities.

Each request keeps its own ``torch.Generator`` seeded from its seed, so its samples do not
depend on what else is in the batch. Log-probabilities are those of the model's raw logits
(vLLM's default), before penalties, masks and temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from dynamo.protocol.output import TopLogprob
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.errors import InvalidArgument

MAX_TOP_LOGPROBS = 20
T = TypeVar("T")


class TokenConstraint(Protocol):
    """Per-request logits processor (the guided-decoding seam): ``mask_logits`` is called with
    the request's float32 logits row before sampling and must set disallowed ids to ``-inf``
    in place; ``accept_token`` is called with every token the request emits, in order (its
    result is ignored); once ``is_terminated`` is true nothing may follow and the engine ends
    the request with finish reason ``stop``."""

    def mask_logits(self, logits: torch.Tensor) -> None: ...

    def accept_token(self, token_id: int) -> object: ...

    def is_terminated(self) -> bool: ...


@dataclass(slots=True)
class SamplingParams:
    """One request's sampling settings, validated (``from_request`` raises ``InvalidArgument``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    min_tokens: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @classmethod
    def from_request(cls, request: PreprocessedRequest) -> SamplingParams:
        s = request.sampling
        p = cls(
            temperature=0.0 if s.greedy else _default(s.temperature, 1.0),
            top_p=_default(s.top_p, 1.0),
            top_k=_default(s.top_k, 0),
            min_p=_default(s.min_p, 0.0),
            repetition_penalty=_default(s.repetition_penalty, 1.0),
            presence_penalty=_default(s.presence_penalty, 0.0),
            frequency_penalty=_default(s.frequency_penalty, 0.0),
            logprobs=request.output.logprobs,
            min_tokens=request.stop.min_tokens or 0,
        )
        if p.temperature < 0:
            raise InvalidArgument("temperature must be >= 0")
        if not 0.0 < p.top_p <= 1.0:
            raise InvalidArgument("top_p must be in (0, 1]")
        if p.top_k < 0:
            raise InvalidArgument("top_k must be >= 0 (0: no limit)")
        if not 0.0 <= p.min_p <= 1.0:
            raise InvalidArgument("min_p must be in [0, 1]")
        if p.repetition_penalty <= 0:
            raise InvalidArgument("repetition_penalty must be > 0")
        if not -2.0 <= p.presence_penalty <= 2.0 or not -2.0 <= p.frequency_penalty <= 2.0:
            raise InvalidArgument("presence_penalty and frequency_penalty must be in [-2, 2]")
        if p.logprobs is not None and not 0 <= p.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        prompt = request.output.prompt_logprobs
        if prompt is not None and not 0 <= prompt <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        return p


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


@dataclass(slots=True)
class RequestSampler:
    """Sampling state of one request: its params, generator and optional constraint.

    ``prompt_logprobs`` (when asked for) fills up during prefill: ``None`` for the first prompt
    token, then the log-probability of each next prompt token under the raw logits.
    """

    params: SamplingParams
    generator: torch.Generator
    stop_token_ids: frozenset[int]
    constraint: TokenConstraint | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_logprobs_sent: bool = False


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row besides its logits."""

    sampler: RequestSampler
    prompt_tokens: Sequence[int]  # the sequence's prompt (a list: a live request's)
    output_tokens: list[int]


@dataclass(slots=True)
class Sampled:
    token: int
    logprob: float | None = None
    top: list[TopLogprob] = field(default_factory=list)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[Sampled]:
    """One token per row of ``logits [rows, vocab]`` (float32; modified in place)."""
    raw_logprobs = None
    if any(r.sampler.params.logprobs is not None for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    for i, row in enumerate(rows):
        _process_row(logits[i], row)
    out: list[Sampled] = []
    greedy = logits.argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        p = row.sampler.params
        token = greedy[i] if p.is_greedy else _sample_row(logits[i], p, row.sampler.generator)
        result = Sampled(token)
        if raw_logprobs is not None and p.logprobs is not None:
            lp = raw_logprobs[i]
            result.logprob = float(lp[token])
            if p.logprobs:
                values, ids = lp.topk(p.logprobs)
                result.top = [
                    TopLogprob(t, v) for t, v in zip(ids.tolist(), values.tolist(), strict=True)
                ]
        out.append(result)
    return out


def _process_row(logits: torch.Tensor, row: SampleRow) -> None:
    """Penalties, min_tokens and the constraint, in place on one row."""
    s = row.sampler
    p = s.params
    if p.has_penalties:
        _apply_penalties(logits, p, row.prompt_tokens, row.output_tokens)
    if len(row.output_tokens) < p.min_tokens and s.stop_token_ids:
        ids = [t for t in s.stop_token_ids if 0 <= t < logits.shape[0]]
        logits[ids] = float("-inf")
    if s.constraint is not None:
        s.constraint.mask_logits(logits)


def _apply_penalties(
    logits: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: list[int]
) -> None:
    """vLLM's rules: repetition over prompt and output tokens (divide positive logits, multiply
    negative ones), presence and frequency over output tokens only (OpenAI)."""
    vocab = logits.shape[0]
    device = logits.device
    if output:
        counts = torch.bincount(torch.tensor(output, device=device), minlength=vocab)[:vocab]
    else:
        counts = torch.zeros(vocab, dtype=torch.int64, device=device)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt:
            seen[torch.tensor(prompt, device=device).clamp(0, vocab - 1)] = True
        penalized = torch.where(
            logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty
        )
        logits.copy_(torch.where(seen, penalized, logits))
    if p.frequency_penalty:
        logits -= p.frequency_penalty * counts.to(logits.dtype)
    if p.presence_penalty:
        logits -= p.presence_penalty * (counts > 0).to(logits.dtype)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    scaled = logits / p.temperature
    vocab = scaled.shape[0]
    if 0 < p.top_k < vocab:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > p.top_p  # keeps at least the first
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & ((1 << 64) - 1))
    return gen

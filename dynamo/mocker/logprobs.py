"""Log-probabilities for the mocker's random tokens.

The mocker samples its output ids uniformly; for ``OutputOptions.logprobs`` it invents, per
position, a plausible next-token distribution around the id it produced: a top probability
between 0.25 and 0.95, alternatives decaying geometrically, the chosen id at a rank drawn from
that distribution (usually the first, sometimes outside the listed alternatives). Everything is
a function of the request's seed and the position, so a seeded request gets the same numbers
every time. Prompt log-probabilities (``echo``) are drawn the same way.
"""

from __future__ import annotations

import math
import random

import xxhash

from dynamo.mocker.config import MockerConfig
from dynamo.mocker.sequence import request_seed
from dynamo.protocol.model_card import EngineCapabilities
from dynamo.protocol.output import LLMEngineOutput, TopLogprob
from dynamo.protocol.request import PreprocessedRequest

MAX_TOP_LOGPROBS = 20
CAPABILITIES = EngineCapabilities(
    logprobs=True, max_top_logprobs=MAX_TOP_LOGPROBS, prompt_logprobs=True
)
"""What the mocker honours beyond the basic fields: log-probabilities (also of the prompt). No
guided decoding, penalties or min_p: its tokens are random, so it could only pretend."""

_LISTED = 5  # alternatives the distribution always has, so rank draws do not depend on ``top``


class MockLogprobs:
    """Adds ``log_probs`` / ``top_logprobs`` (and ``prompt_logprobs`` on the first chunk) to the
    chunks of one request, in order."""

    __slots__ = ("_seed", "_vocab", "_special", "_top", "_pos", "_prompt")

    def __init__(
        self,
        seed: int,
        vocab_size: int,
        special: frozenset[int],
        top: int,
        prompt: list[int] | None,
    ) -> None:
        self._seed = seed
        self._vocab = vocab_size
        self._special = special
        self._top = top
        self._pos = 0
        self._prompt = prompt

    @staticmethod
    def for_request(
        config: MockerConfig, request: PreprocessedRequest, seed_id: str
    ) -> MockLogprobs | None:
        out = request.output
        if out.logprobs is None and out.prompt_logprobs is None:
            return None
        seed = request_seed(seed_id, request.sampling.seed)
        prompt = list(request.token_ids) if out.prompt_logprobs is not None else None
        return MockLogprobs(
            seed, config.vocab_size, config.special_token_ids, out.logprobs or 0, prompt
        )

    def annotate(self, out: LLMEngineOutput) -> LLMEngineOutput:
        if self._prompt is not None:
            prompt, self._prompt = self._prompt, None
            out.prompt_logprobs = [None] + [self._prompt_logprob(i) for i in range(1, len(prompt))]
        if out.token_ids:
            logprobs: list[float] = []
            tops: list[list[TopLogprob]] = []
            for token_id in out.token_ids:
                logprob, top = self.position(self._pos, token_id)
                self._pos += 1
                logprobs.append(logprob)
                tops.append(top)
            out.log_probs = logprobs
            out.top_logprobs = tops
        return out

    def position(self, pos: int, token_id: int) -> tuple[float, list[TopLogprob]]:
        """The chosen id's log-probability at output position ``pos`` and the ``top`` most
        likely ids there (most likely first; the chosen id among them when its rank is)."""
        rng = self._rng(pos)
        n = max(self._top, _LISTED)
        probs = [0.25 + 0.7 * rng.random()]
        for _ in range(n - 1):
            probs.append(probs[-1] * (0.1 + 0.6 * rng.random()))
        total = sum(probs)
        if total > 0.98:
            probs = [p * 0.98 / total for p in probs]
        # the chosen id's rank: drawn from the distribution itself (n = not listed)
        u, rank, acc = rng.random(), n, 0.0
        for i, p in enumerate(probs):
            acc += p
            if u < acc:
                rank = i
                break
        chosen = math.log(probs[rank]) if rank < n else math.log(probs[-1] * rng.uniform(0.05, 0.9))
        used = {token_id}
        top: list[TopLogprob] = []
        for i, p in enumerate(probs[: self._top]):
            if i == rank:
                alt = token_id
            else:
                alt = self._other_id(rng, used)
            top.append(TopLogprob(alt, math.log(p)))
        return chosen, top

    def _prompt_logprob(self, pos: int) -> float:
        rng = self._rng(-1 - pos)
        return math.log(0.002 + 0.9 * rng.random() ** 2)

    def _rng(self, pos: int) -> random.Random:
        return random.Random(xxhash.xxh3_64_intdigest(f"{self._seed}:{pos}".encode()))

    def _other_id(self, rng: random.Random, used: set[int]) -> int:
        """A vocabulary id not yet listed at this position and not special."""
        for _ in range(64):
            candidate = rng.randrange(self._vocab)
            if candidate not in used and candidate not in self._special:
                used.add(candidate)
                return candidate
        candidate = max(used) + 1  # a tiny vocabulary: take the next unused id
        used.add(candidate)
        return candidate

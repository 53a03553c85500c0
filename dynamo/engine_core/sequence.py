"""Per-request state of the shared scheduler: tokens, progress, held KV blocks, stop rules.

The scheduler reasons with two numbers, as vLLM v1 does: ``num_tokens`` (prompt + generated) and
``num_computed_tokens`` (tokens whose KV is in the cache). A pass computes some of the difference;
when they meet, the pass samples one new token.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import xxhash

from dynamo import native
from dynamo.engine_core.config import SchedulerLimits
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.output import FinishReason
from dynamo.protocol.request import PreprocessedRequest
from dynamo.router.hashing import (
    block_hash,
    block_seed,
    local_block_hashes,
    next_sequence_hash,
    sequence_hashes,
)

_kernel = native.load("dynamo.engine_core._sequence", "dynamo.engine_core._sequence_fallback")
if TYPE_CHECKING:
    from dynamo.engine_core._sequence import new_sequence as new_sequence
else:
    # :func:`sequence_from_request` from the request's fields (contract: ``_sequence.pyi``):
    # the offline replay builds one sequence per simulated request, the live engines one per
    # request through sequence_from_request; native, its Python checks and field computations
    # were ~14k instructions a sequence
    new_sequence = _kernel.new_sequence


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """One request inside one DP rank's scheduler. Mutated only by that scheduler.

    Block layout (``B`` = block size; the tokens are ``prompt`` then ``output``)::

        tokens:  | block 0 | block 1 | ... | block k-1 | tail (< B tokens) |
        held:    | full_blocks (sequence hashes, shared) | unique_blocks   |

    ``prompt`` is the caller's list, kept as handed in and never changed (a prompt of 1,152
    ids is not copied per request, nor freed and traversed twice); the sampled ids go to
    ``output``.

    ``full_blocks`` are complete, hashed blocks (shareable via the prefix cache); ``unique_blocks``
    are this sequence's private blocks: the growing tail, or every block when prefix caching is
    off. ``block_hashes``/``local_hashes`` cover every complete block of the known tokens, whether
    or not its KV is held.
    """

    request_id: str
    prompt: list[int] | array[int]
    """The prompt's ids: the caller's list, read and never changed (``len`` is
    ``num_prompt_tokens``), or the caller's packed ids (an ``array('I')``: the offline
    replay's)."""
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    block_size: int
    lora_name: str | None
    rng_state: int
    """Per-request seed (the request's ``sampling.seed``, else derived from its id): the
    mocker's ids are a function of (seed, position); a real engine seeds its sampler with it."""
    stop_token_ids: frozenset[int]
    banned_token_ids: frozenset[int]
    """The request's EOS ids: the mocker never samples them (they are special tokens)."""
    arrival: float
    handoff: DisaggregatedParams | None = None
    """Decode side of disaggregation: the prompt's KV arrives from this prefill worker."""
    pending_transfer: bool = False
    reuse_prefix_cache: bool = True
    """False when every prompt position must be computed (prompt log-probabilities)."""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    prefill_end: int = 0
    """``num_tokens`` when the sequence was (re)admitted: below it a pass is a prefill chunk."""
    num_cached_tokens: int | None = None
    """Tokens found in the cache (or transferred) at the first admission; set once, as vLLM."""
    ready_at: float = 0.0
    """Earliest time the sequence may run (a decode-side KV transfer lands then)."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    output: list[int] = field(default_factory=list)
    """The sampled ids, in order."""
    local_hashes: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    full_blocks: list[int] = field(default_factory=list)
    unique_blocks: list[int] = field(default_factory=list)
    hash_seed: int = 0
    """The block hash seed of this request (its LoRA's), computed once."""
    full_slots: bytearray | None = field(default=None, compare=False, repr=False)
    """The native KV manager's table slot of each of ``full_blocks`` (native int32s), kept by
    the native pass so that a release finds each block without converting and looking up its
    hash again; None when not kept (the Python pass and KV manager keep none). A hint: the
    release checks each slot against its hash and looks up any that does not match."""

    def __post_init__(self) -> None:
        self.hash_seed = block_seed(self.lora_name)
        if len(self.local_hashes) != self.num_tokens // self.block_size:  # not handed in
            self.local_hashes = local_block_hashes(
                self.tokens(0, self.num_tokens), self.block_size, lora_name=self.lora_name
            )
            self.block_hashes = sequence_hashes(self.local_hashes)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    def tokens(self, start: int, end: int) -> list[int]:
        """The ids at positions ``start`` to ``end`` (a new list; ``0 <= start <= end <=
        num_tokens``), across the prompt and the output."""
        p = self.num_prompt_tokens
        if start >= p and end > p:
            return self.output[start - p : end - p]
        head = self.prompt[start : min(end, p)]
        ids = head if isinstance(head, list) else head.tolist()  # a packed prompt's
        return ids if end <= p else ids + self.output[: end - p]

    @property
    def num_held_blocks(self) -> int:
        return len(self.full_blocks) + len(self.unique_blocks)

    @property
    def is_decoding(self) -> bool:
        """Past its (re)admission prefill: the next pass computes exactly one token."""
        return self.num_computed_tokens >= self.prefill_end

    def append_token(self, token: int) -> None:
        """Add a sampled token; hash the block it completes (if any)."""
        self.output.append(token)
        bs = self.block_size
        n = self.num_prompt_tokens + len(self.output)
        if n % bs == 0:  # per token on the hot path: only a completed block costs more
            local = block_hash(self.tokens(n - bs, n), self.hash_seed)
            chain = self.block_hashes
            self.local_hashes.append(local)
            chain.append(next_sequence_hash(chain[-1], local) if chain else local)

    def finish_after(self, token: int) -> FinishReason | None:
        """The finish reason once ``token`` has been appended, or None to keep going."""
        n = len(self.output)  # num_output_tokens
        if n >= self.max_tokens:
            return FinishReason.LENGTH
        if n >= self.min_tokens and token in self.stop_token_ids:
            return FinishReason.STOP
        return None


def request_seed(request_id: str, seed: int | None) -> int:
    """Per-request RNG seed: the request's ``sampling.seed``, else derived from its id (stable
    across processes, unlike ``hash()``)."""
    if seed is not None:
        return seed
    return int(xxhash.xxh3_64_intdigest(request_id.encode()))


def sequence_from_request(
    config: SchedulerLimits,
    request: PreprocessedRequest,
    request_id: str,
    now: float,
    *,
    seed_id: str | None = None,
    hashes: tuple[list[int], list[int]] | None = None,
) -> Sequence:
    """Build a request's state, applying the worker's role, or raise ``InvalidArgument`` if it
    can never run on this worker: an empty prompt, prompt + max_tokens beyond the context
    length or the KV pool of one rank, or (without chunked prefill) a prompt beyond the budget.

    A prefill worker runs the prompt and one token; a decode worker takes the request's
    handoff (``prefill_result``) and receives the prompt's KV instead of computing it. Output
    ids are seeded by ``sampling.seed``, else by ``seed_id`` (default: ``request_id``).
    ``hashes``: the prompt's (local, sequence) block hashes when the caller has them already
    (the offline replay hashes once for the router and the engine); the lists are handed over
    (the sequence appends its output's blocks to them), and the prompt is kept, not copied:
    the caller changes neither afterwards.
    """
    stop = request.stop
    return new_sequence(
        config,
        request.token_ids,
        request_id,
        now,
        max_tokens=stop.max_tokens,
        min_tokens=stop.min_tokens or 0,
        stop_token_ids=stop.stop_token_ids,
        eos_token_ids=request.eos_token_ids,
        ignore_eos=stop.ignore_eos,
        lora_name=request.lora_name,
        seed=request.sampling.seed,
        handoff=request.prefill_result,
        reuse_prefix_cache=request.output.prompt_logprobs is None,
        seed_id=seed_id,
        hashes=hashes,
    )

"""The mocker's stand-in for a model: the shared scheduler (``dynamo.engine_core``) plus a timing
model (how long a pass takes, FACTS §6.4) and a token sampler (what it outputs: random ids).

``MockerScheduler.step(now)`` is one simulated forward pass: schedule, time, sample, update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamo.engine_core.pass_kernels import sample_tokens
from dynamo.engine_core.scheduler import Scheduler
from dynamo.engine_core.sequence import Sequence
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.timing import TimingModel
from dynamo.protocol.kv_events import KVCacheEvent


@dataclass(slots=True)
class StepOutput:
    """What one pass did. ``duration`` is clock seconds (0 at speedup 0); the tokens exist at
    ``start + duration``. ``events`` are the KV events of the pass, in order (one ``bytes``,
    ``dynamo.protocol.kv_raw``, once the KV manager records them raw: the offline replay)."""

    start: float
    duration: float = 0.0
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    decode_context_tokens: int = 0
    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    events: list[KVCacheEvent] | bytes = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing ran (idle, or every running request waits for a KV transfer)."""
        return self.num_prefill_tokens == 0 and self.num_decodes == 0


class MockerScheduler(Scheduler):
    """The shared scheduler driven by the mocker's timing model and random tokens."""

    def __init__(self, config: MockerConfig, *, dp_rank: int = 0) -> None:
        super().__init__(config, dp_rank=dp_rank)
        self.mocker_config = config
        self.timing = TimingModel(
            total_kv_tokens=config.total_kv_tokens,
            speedup_ratio=config.speedup_ratio,
            decode_speedup_ratio=config.decode_speedup_ratio,
            kv_transfer_bandwidth=config.kv_transfer_bandwidth,
            kv_bytes_per_token=config.kv_bytes_per_token,
        )
        self._sampler = TokenSampler(config.vocab_size, config.special_token_ids)
        # read once a pass: held here, not looked up through the sampler's properties (the
        # replay's native loop, replay/_loop.c, reads them too: it times the pass itself)
        self._pass_seconds = self.timing.pass_seconds
        self._vocab_size, self._excluded = self._sampler.vocab_size, self._sampler.excluded

    def transfer_seconds(self, num_prompt_tokens: int) -> float:
        return self.timing.transfer_seconds(num_prompt_tokens)

    def step(self, now: float) -> StepOutput:
        """Schedule, time and apply one forward pass starting at ``now`` (one kernel call:
        ``Scheduler.mock_pass``)."""
        preempted, prefill, decodes, context, tokens, finished, events = self.mock_pass(
            now, self._vocab_size, self._excluded
        )
        duration = self._pass_seconds(prefill, context, decodes)
        return StepOutput(
            now, duration, prefill, decodes, context, tokens, finished, preempted, events
        )


class TokenSampler:
    """Random output ids from ``[0, vocab_size)`` that are never in ``excluded`` (special ids).

    The id at a position depends only on the request's seed and the position in the sequence
    (prompt included): a request migrated to another worker with the tokens generated so far
    appended to its prompt (same request id, so same seed) continues with exactly the ids an
    uninterrupted run would have produced. Cheap: a 64-bit mix, no per-request generator.
    """

    __slots__ = ("_vocab_size", "_excluded")

    def __init__(self, vocab_size: int, excluded: frozenset[int]) -> None:
        if len([t for t in excluded if 0 <= t < vocab_size]) >= vocab_size:
            raise ValueError("every vocabulary id is excluded")
        self._vocab_size = vocab_size
        self._excluded = excluded

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def excluded(self) -> frozenset[int]:
        """Ids never sampled (the special tokens)."""
        return self._excluded

    def sample_batch(self, entries: list[tuple[Sequence, int]]) -> list[int | None]:
        """The next id of each batch entry ``(seq, n)`` that samples in this pass (it reaches
        the end of its known tokens: ``ScheduledBatch.samples``), None for the others. One call
        per pass: this runs for every output token. Rejection sampling (an LCG walk from the
        mixed state): special ids are few, so this almost never loops."""
        return sample_tokens(entries, self._vocab_size, self._excluded)

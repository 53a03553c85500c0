"""The mocker's scheduling policy for one DP rank (vLLM v1 semantics, FACTS §6.2).

Each ``step(now)`` is one forward pass: the token budget goes to running requests first (a decode
costs one token), then to chunked prefill of waiting requests in FIFO order. Blocks are carried
out by ``KVManager`` (mechanism); durations come from ``TimingModel``. Pure and synchronous: the
engine loop or an offline replay drives it on any clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from dynamo.mocker.config import MockerConfig
from dynamo.mocker.kv_manager import KVManager
from dynamo.mocker.sequence import Sequence, SequenceStatus, TokenSampler, sequence_from_request
from dynamo.mocker.timing import TimingModel
from dynamo.protocol.kv_events import KVCacheEvent
from dynamo.protocol.load import WorkerLoad
from dynamo.protocol.output import FinishReason
from dynamo.protocol.request import PreprocessedRequest


@dataclass(slots=True)
class StepOutput:
    """What one pass did. ``duration`` is clock seconds (0 at speedup 0); the tokens exist at
    ``start + duration``. ``events`` are the KV events of the pass, in order."""

    start: float
    duration: float = 0.0
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    decode_context_tokens: int = 0
    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    events: list[KVCacheEvent] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing ran (idle, or every running request waits for a KV transfer)."""
        return self.num_prefill_tokens == 0 and self.num_decodes == 0


class Scheduler:
    """Waiting queue + running list of one DP rank, mutated only by ``add_request``, ``abort``
    and ``step`` (all from one task)."""

    def __init__(self, config: MockerConfig, *, dp_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.kv = KVManager(
            config.num_gpu_blocks,
            dp_rank=dp_rank,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.timing = TimingModel(
            total_kv_tokens=config.total_kv_tokens,
            speedup_ratio=config.speedup_ratio,
            decode_speedup_ratio=config.decode_speedup_ratio,
            kv_transfer_bandwidth=config.kv_transfer_bandwidth,
            kv_bytes_per_token=config.kv_bytes_per_token,
        )
        self._sampler = TokenSampler(config.vocab_size, config.special_token_ids)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def next_ready_at(self) -> float | None:
        """Earliest time a running request that waits for its KV transfer becomes runnable."""
        times = [s.ready_at for s in self._running if s.pending_transfer]
        return min(times) if times else None

    def load(self, worker_id: int) -> WorkerLoad:
        active = self.kv.num_active_blocks
        return WorkerLoad(
            worker_id=worker_id,
            dp_rank=self.dp_rank,
            active_decode_blocks=active,
            total_blocks=self.kv.num_blocks,
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            kv_usage=active / self.kv.num_blocks,
        )

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request: PreprocessedRequest, request_id: str, now: float) -> Sequence:
        """Validate and queue a request (``sequence_from_request`` raises ``InvalidArgument``
        for one that can never run here)."""
        seq = sequence_from_request(self.config, request, request_id, now)
        self.enqueue(seq)
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Queue an already-built sequence at the back of the waiting queue. ``ValueError`` for
        a duplicate ``request_id`` or a sequence that is not fresh."""
        if seq.request_id in self._requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if seq.status is not SequenceStatus.WAITING or seq.num_held_blocks:
            raise ValueError("only a fresh sequence can be queued")
        self._requests[seq.request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. False if unknown (already done)."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
            self._free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.CANCELLED
        return True

    # -- the pass ---------------------------------------------------------------------------
    def step(self, now: float) -> StepOutput:
        """Schedule, time and apply one forward pass starting at ``now``."""
        out = StepOutput(start=now)
        budget = self.config.max_num_batched_tokens
        bs = self.config.block_size
        scheduled: dict[int, tuple[Sequence, int]] = {}
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            i += 1
            if seq.pending_transfer:
                if seq.ready_at > now:
                    continue
                seq.pending_transfer = False
            if seq.num_computed_tokens >= seq.prefill_end and len(seq.tokens) > bs * (
                len(seq.full_blocks) + len(seq.unique_blocks)
            ):  # a decode whose token starts a new block
                while not self._grow(seq):
                    victim = self._victim()
                    if running.index(victim) < i:
                        i -= 1
                    entry = scheduled.pop(id(victim), None)
                    budget += entry[1] if entry else 0
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
            n = min(len(seq.tokens) - seq.num_computed_tokens, budget)
            scheduled[id(seq)] = (seq, n)
            budget -= n
        if not out.preempted:
            budget = self._admit_waiting(now, budget, scheduled)
        self._run(out, scheduled.values())
        out.events = self.kv.drain_events()
        return out

    def _admit_waiting(
        self, now: float, budget: int, scheduled: dict[int, tuple[Sequence, int]]
    ) -> int:
        cfg = self.config
        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            seq = self._waiting[0]
            if not self._allocate(seq, budget):
                break  # head-of-line: later requests wait behind it (FIFO)
            self._waiting.popleft()
            self._running.append(seq)
            if seq.pending_transfer:
                seq.ready_at = now + self.timing.transfer_seconds(seq.num_prompt_tokens)
                if seq.ready_at > now:
                    continue
                seq.pending_transfer = False
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            scheduled[id(seq)] = (seq, n)
            budget -= n
        return budget

    def _allocate(self, seq: Sequence, budget: int) -> bool:
        """Admit ``seq``: find its cached prefix and take blocks for all its tokens (FACTS §6.2:
        the whole prompt at the first chunk). False (nothing changed) if it cannot start now."""
        cfg, bs, n_tokens = self.config, self.config.block_size, seq.num_tokens
        if seq.pending_transfer:
            computed = n_tokens - 1  # KV arrives from the prefill worker; recompute the last one
        else:
            hit = self.kv.num_cached_prefix(seq.block_hashes)
            computed = min(hit * bs, n_tokens - 1)  # like vLLM, always compute >= 1 token
        new_tokens = n_tokens - computed
        if not cfg.enable_chunked_prefill and budget < new_tokens <= cfg.max_num_batched_tokens:
            # Wait for a pass with room. Larger ones (recomputes after a preemption) are chunked
            # anyway: no pass could ever hold them.
            return False
        n_full = n_tokens // bs if cfg.enable_prefix_caching else 0
        n_unique = -(-n_tokens // bs) - n_full
        full, local = seq.block_hashes[:n_full], seq.local_hashes[:n_full]
        if self.kv.num_slots_needed(full, n_unique) > self.kv.num_available_blocks:
            return False
        if full:
            self.kv.use(full, local)
        unique = self.kv.allocate_unique(n_unique)
        assert unique is not None  # room was checked above
        seq.full_blocks, seq.unique_blocks = full, unique
        seq.num_computed_tokens = computed
        seq.prefill_end = computed if seq.pending_transfer else n_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = computed
        seq.status = SequenceStatus.RUNNING
        return True

    def _grow(self, seq: Sequence) -> bool:
        """Make room for the token a decode computes (a new tail block at a block boundary)."""
        missing = -(-seq.num_tokens // self.config.block_size) - seq.num_held_blocks
        if missing <= 0:
            return True
        ids = self.kv.allocate_unique(missing)
        if ids is None:
            return False
        seq.unique_blocks.extend(ids)
        return True

    def _victim(self) -> Sequence:
        return self._running[-1] if self.config.preemption_mode == "lifo" else self._running[0]

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks (they stay cached), reset progress, requeue at the front."""
        self._running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = seq.prefill_end = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        self.kv.release(seq.full_blocks, seq.unique_blocks)
        seq.full_blocks, seq.unique_blocks = [], []

    def _run(self, out: StepOutput, batch: Iterable[tuple[Sequence, int]]) -> None:
        """Time the batch, then advance every sequence in it (promote filled tail blocks, sample
        a token for those that caught up, retire the finished)."""
        for seq, n in batch:
            if seq.num_computed_tokens >= seq.prefill_end:
                out.num_decodes += 1
                out.decode_context_tokens += len(seq.tokens)
            else:
                out.num_prefill_tokens += n
        out.duration = self.timing.pass_seconds(
            out.num_prefill_tokens, out.decode_context_tokens, out.num_decodes
        )
        bs, caching = self.config.block_size, self.config.enable_prefix_caching
        sample, tokens_out = self._sampler.sample, out.tokens
        for seq, n in batch:
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            if caching and seq.unique_blocks and computed >= (len(seq.full_blocks) + 1) * bs:
                self._promote_filled(seq)
            if computed < len(seq.tokens):
                continue  # a prefill chunk that has not reached the end
            token = sample(seq)
            seq.append_token(token)
            tokens_out.append((seq, token))
            reason = seq.finish_after(token)
            if reason is not None:
                seq.finish_reason, seq.status = reason, SequenceStatus.FINISHED
                out.finished.append(seq)
        if out.finished:
            for seq in out.finished:
                self._free(seq)
                del self._requests[seq.request_id]
            self._running = [s for s in self._running if s.status is SequenceStatus.RUNNING]

    def _promote_filled(self, seq: Sequence) -> None:
        """Private tail blocks whose KV is complete become shareable full blocks."""
        bs = self.config.block_size
        while seq.unique_blocks and (len(seq.full_blocks) + 1) * bs <= seq.num_computed_tokens:
            k = len(seq.full_blocks)
            h = seq.block_hashes[k]
            parent = seq.block_hashes[k - 1] if k else None
            self.kv.promote(seq.unique_blocks.pop(0), h, seq.local_hashes[k], parent)
            seq.full_blocks.append(h)

    # -- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if queues, sequences and the KV pools disagree."""
        kv, bs = self.kv, self.config.block_size
        kv.check_invariants()
        assert len(self._running) <= self.config.max_num_seqs
        assert {s.request_id for s in (*self._waiting, *self._running)} == set(self._requests)
        assert len(self._waiting) + len(self._running) == len(self._requests)
        refs: dict[int, int] = {}
        n_unique = 0
        for seq in self._waiting:
            assert seq.status is SequenceStatus.WAITING and seq.num_held_blocks == 0
            assert seq.num_computed_tokens == 0
        for seq in self._running:
            assert seq.status is SequenceStatus.RUNNING
            assert seq.full_blocks == seq.block_hashes[: len(seq.full_blocks)], "broken chain"
            assert -(-seq.num_computed_tokens // bs) <= seq.num_held_blocks
            assert seq.num_held_blocks <= -(-seq.num_tokens // bs)
            for h in seq.full_blocks:
                refs[h] = refs.get(h, 0) + 1
            n_unique += len(seq.unique_blocks)
        assert all(kv.refcount(h) == rc for h, rc in refs.items()), "refcount mismatch"
        assert kv.num_active_blocks == len(refs) + n_unique, "leaked active blocks"

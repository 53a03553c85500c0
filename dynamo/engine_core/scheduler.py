"""The shared scheduling policy for one DP rank (vLLM v1 semantics, FACTS §6.2).

Each pass is ``schedule(now)`` then ``update(batch, sampled)``: the token budget goes to running
requests first (a decode costs one token), then to chunked prefill of waiting requests in FIFO
order; between the two, the engine runs the batch. The mocker times it with its model of a GPU
(``dynamo.mocker.simulator``), the PyTorch engine runs a real model (``dynamo.pytorch``): what
the mocker predicts is what the real engine schedules. Blocks are carried out by ``KVManager``
(mechanism). Pure and synchronous: one owner (task or thread) drives it on any clock.

Cache rule (as vLLM): a block is stored in the prefix cache, and announced, only once its KV is
computed (``update`` promotes filled blocks). A request admitted while another still computes
the same prefix therefore never reads KV that does not exist yet.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dynamo.engine_core.config import SchedulerLimits
from dynamo.engine_core.kv_manager import KVManager
from dynamo.engine_core.pass_kernels import mock_pass, release_blocks, schedule_pass, update_pass
from dynamo.engine_core.sequence import Sequence, SequenceStatus, sequence_from_request
from dynamo.protocol.kv_events import KVCacheEvent
from dynamo.protocol.load import WorkerLoad
from dynamo.protocol.output import FinishReason
from dynamo.protocol.request import PreprocessedRequest


@dataclass(slots=True)
class ScheduledBatch:
    """What one pass computes: ``entries`` are ``(sequence, number of new tokens)`` in batch
    order. An entry *samples* (produces a token) when it reaches the end of its known tokens."""

    start: float
    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    decode_context_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing to run (idle, or every running request waits for a KV transfer)."""
        return not self.entries

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    @staticmethod
    def samples(seq: Sequence, n: int) -> bool:
        """Whether the entry ``(seq, n)`` produces a token in this pass."""
        return seq.num_computed_tokens + n >= seq.num_tokens


@dataclass(slots=True)
class UpdateResult:
    """What applying a pass changed: new tokens, finished requests, KV events (in order)."""

    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    events: list[KVCacheEvent] = field(default_factory=list)


class Scheduler:
    """Waiting queue + running list of one DP rank, mutated only by ``add_request``, ``abort``
    and ``step`` (all from one task)."""

    def __init__(self, config: SchedulerLimits, *, dp_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.kv = KVManager(
            config.num_gpu_blocks,
            dp_rank=dp_rank,
            enable_prefix_caching=config.enable_prefix_caching,
        )
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
        return self.finish(request_id, FinishReason.CANCELLED) is not None

    def finish(self, request_id: str, reason: FinishReason) -> Sequence | None:
        """End a request now with ``reason`` (an abort, or an engine's own stop rule such as a
        completed grammar) and free its blocks; its freed blocks' events come with the next
        ``drain_events``. None if unknown (already finished)."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
            self._free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        return seq

    # -- the pass ---------------------------------------------------------------------------
    def transfer_seconds(self, num_prompt_tokens: int) -> float:
        """How long a decode-side request waits for its prompt's KV (0: it is there at once).
        The mocker overrides it with its transfer model."""
        return 0.0

    def schedule(self, now: float) -> ScheduledBatch:
        """Decide the pass starting at ``now``: admit, allocate, preempt. The caller runs the
        batch, then calls ``update`` with what it sampled. One kernel call (``schedule_pass``)."""
        entries, preempted, prefill, decodes, context = schedule_pass(
            self._running, self._waiting, self.kv, self.config, now, self.transfer_seconds
        )
        return ScheduledBatch(now, entries, preempted, prefill, decodes, context)

    def _free(self, seq: Sequence) -> None:
        release_blocks(self.kv, seq)

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> UpdateResult:
        """Apply a pass the engine ran: advance every entry, store the blocks it filled, append
        the token of each sampling entry (``sampled[i]`` for ``batch.entries[i]``; ``None``
        for entries that do not sample) and retire the finished. One kernel call
        (``update_pass``)."""
        tokens, finished, events = update_pass(
            batch.entries, sampled, self._running, self._requests, self.kv, self.config.block_size
        )
        return UpdateResult(tokens, finished, events)

    def mock_pass(
        self, now: float, vocab_size: int, excluded: frozenset[int]
    ) -> tuple[
        list[Sequence],
        int,
        int,
        int,
        list[tuple[Sequence, int]],
        list[Sequence],
        list[KVCacheEvent] | bytes,
    ]:
        """``schedule(now)``, the mocker's ids for the batch (``sample_tokens`` with
        ``vocab_size`` / ``excluded``) and ``update`` in one kernel call, for an engine that
        needs no batch in between (the mocker). Returns ``(preempted, num_prefill_tokens,
        num_decodes, decode_context_tokens, tokens, finished, events)``; ``events`` are one
        ``bytes`` (``dynamo.protocol.kv_raw``) once ``self.kv.record_raw_events()`` was called
        (the offline replay)."""
        return mock_pass(
            self._running,
            self._waiting,
            self._requests,
            self.kv,
            self.config,
            now,
            self.transfer_seconds,
            vocab_size,
            excluded,
        )

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
            if seq.full_slots is not None:  # the native pass's kept slots: each block's own
                kept = memoryview(seq.full_slots).cast("i").tolist()
                assert kept == [kv.slot_of(h) for h in seq.full_blocks], "stale kept slots"
            for h in seq.full_blocks:
                refs[h] = refs.get(h, 0) + 1
            n_unique += len(seq.unique_blocks)
        assert all(kv.refcount(h) == rc for h, rc in refs.items()), "refcount mismatch"
        assert kv.num_active_blocks == len(refs) + n_unique, "leaked active blocks"

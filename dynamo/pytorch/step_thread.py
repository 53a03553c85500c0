"""``StepThread``: the engine's step loop, in its own thread so that the event loop (HTTP,
transport) stays responsive while the model runs.

It alone owns the scheduler, the KV manager, the runner and the pools. The event loop talks to
it through ``submit`` (a locked inbox; adds, aborts and calls run between passes) and hears
back through ``on_report``, which the thread calls once per pass (the engine forwards it to the
loop with ``call_soon_threadsafe``)::

    loop thread                         step thread
    -----------                         -----------
    submit(Add/Abort/Call) --inbox-->   drain inbox; schedule; run model; sample; update
    deliver(report)    <--report----    StepReport(outputs, finished, KV events, load)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynamo.engine_core.scheduler import Scheduler
from dynamo.engine_core.sequence import Sequence
from dynamo.protocol.kv_events import KVCacheEvent
from dynamo.protocol.load import WorkerLoad
from dynamo.protocol.output import FinishReason, TopLogprob
from dynamo.pytorch.runner import ModelRunner
from dynamo.pytorch.sampler import RequestSampler

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.001
"""How long the loop sleeps when requests exist but none can run (no busy spinning)."""


@dataclass(slots=True)
class Add:
    seq: Sequence
    sampler: RequestSampler


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Call:
    """Run ``fn()`` on the step thread between passes; ``done(result, error)`` gets the outcome."""

    fn: Callable[[], Any]
    done: Callable[[Any, BaseException | None], None]


Command = Add | Abort | Call


@dataclass(slots=True)
class TokenOutput:
    request_id: str
    token: int
    logprob: float | None
    top: list[TopLogprob]
    prompt_logprobs: list[float | None] | None = None
    """Set on the request's first token only, when it asked for them."""


@dataclass(slots=True)
class StepReport:
    outputs: list[TokenOutput] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    events: list[KVCacheEvent] = field(default_factory=list)
    load: WorkerLoad | None = None


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters of the step loop (read by the metrics collector; plain ints, so a
    read from another thread sees a consistent-enough snapshot)."""

    num_steps: int = 0
    step_seconds: float = 0.0
    num_batched_requests: int = 0
    num_batched_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    max_batch_requests: int = 0


class StepThread:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        on_report: Callable[[StepReport], None],
        *,
        worker_id: int,
        name: str = "pytorch-step",
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.stats = EngineStats()
        self._on_report = on_report
        self._worker_id = worker_id
        self._samplers: dict[str, RequestSampler] = {}
        self._inbox: list[Command] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.crashed: BaseException | None = None
        self.on_crash: Callable[[BaseException], None] = lambda exc: None

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: Command) -> None:
        with self._cv:
            self._inbox.append(command)
            self._cv.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current pass (idempotent)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the loop (step thread only) ------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._report(StepReport(load=self.scheduler.load(self._worker_id)))
            while True:
                with self._cv:
                    while not self._inbox and not self.scheduler.has_work and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                report = StepReport()
                self._apply(inbox, report)
                self._step(report)
                report.load = self.scheduler.load(self._worker_id)
                self._report(report)
        except BaseException as exc:  # a crash must reach the requests, not vanish
            log.exception("pytorch step loop crashed")
            self.crashed = exc
            self.on_crash(exc)

    def _apply(self, inbox: list[Command], report: StepReport) -> None:
        sched = self.scheduler
        for cmd in inbox:
            if isinstance(cmd, Add):
                sched.enqueue(cmd.seq)
                self._samplers[cmd.seq.request_id] = cmd.sampler
            elif isinstance(cmd, Abort):
                if sched.abort(cmd.request_id):
                    self._samplers.pop(cmd.request_id, None)
            else:
                try:
                    result, error = cmd.fn(), None
                except Exception as exc:
                    result, error = None, exc
                cmd.done(result, error)
        report.events.extend(sched.kv.drain_events())

    def _step(self, report: StepReport) -> None:
        sched = self.scheduler
        if not sched.has_work:
            return
        t0 = time.perf_counter()
        batch = sched.schedule(time.monotonic())
        if batch.is_empty:  # nothing runnable yet (cannot happen in aggregated mode): no spin
            with self._cv:
                if not self._inbox and not self._stopping:
                    self._cv.wait(IDLE_WAIT_S)
            return
        sampled = self.runner.run(batch, sched.kv, self._samplers)
        tokens = [s.token if s is not None else None for s in sampled]
        completed: list[str] = []  # guided requests whose grammar allows nothing more
        for (seq, _), s in zip(batch.entries, sampled, strict=True):
            if s is None:
                continue
            sampler = self._samplers[seq.request_id]
            if sampler.constraint is not None:
                sampler.constraint.accept_token(s.token)
                if sampler.constraint.is_terminated():
                    completed.append(seq.request_id)
            out = TokenOutput(seq.request_id, s.token, s.logprob, s.top)
            if sampler.prompt_logprobs is not None and not sampler.prompt_logprobs_sent:
                out.prompt_logprobs, sampler.prompt_logprobs_sent = sampler.prompt_logprobs, True
            report.outputs.append(out)
        result = sched.update(batch, tokens)
        if completed:  # after update: the last token is part of the output
            for request_id in completed:
                done = sched.finish(request_id, FinishReason.STOP)  # None: update ended it
                if done is not None:
                    result.finished.append(done)
            result.events.extend(sched.kv.drain_events())
        for seq in result.finished:
            self._samplers.pop(seq.request_id, None)
            self.stats.num_prompt_tokens += seq.num_prompt_tokens
            self.stats.num_cached_tokens += seq.num_cached_tokens or 0
        report.finished.extend(result.finished)
        report.events.extend(result.events)
        st = self.stats
        st.num_steps += 1
        st.step_seconds += time.perf_counter() - t0
        st.num_batched_requests += len(batch.entries)
        st.max_batch_requests = max(st.max_batch_requests, len(batch.entries))
        st.num_batched_tokens += batch.num_tokens
        st.num_output_tokens += len(result.tokens)
        st.num_preemptions += len(batch.preempted)

    def _report(self, report: StepReport) -> None:
        self._on_report(report)

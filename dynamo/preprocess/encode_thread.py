"""``EncodeThread``: tokenization off the event loop, in batches, on one thread.

HF ``tokenizers`` releases the GIL while it encodes, so a prompt tokenized here uses another
core while the event loop serves other requests (tokenization was ~22 % of the frontend's
event-loop time at c=64). Every prompt submitted while the thread is busy is encoded in its next
batch: one call into Rust (spread over the library's own thread pool when the batch holds several
texts), one GIL hand-over each way and one wake-up of the loop per batch, not per request. That
matters under load: a busy event loop gives the GIL to another thread only every switch interval
(5 ms), so a thread that took one prompt at a time would serve at most a few hundred a second;
batches instead grow with the load.

The thread runs under Linux's ``SCHED_BATCH`` policy (:func:`batch_policy`): a batch thread that
wakes up never preempts the thread running on its core. A prompt's submission wakes this thread
from the event loop's thread, which goes on holding the GIL; as an ordinary thread it often took
the loop's core at once, only to block on the GIL the loop holds (two context switches and an
involuntary one for the loop, the serial resource at c=64). Now it runs on an idle core, or
when the loop's time slice ends. Measured on the stack at c=64: the loop's involuntary context
switches 0.58-0.76 → 0.21-0.40 a request, batches ~2x larger, the thread's CPU a prompt
0.31-0.41 → 0.26-0.30 ms (docs/performance.md, helper ``c64``).

Single-loop use per job; jobs from several loops are each answered on their own loop.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from dynamo.preprocess.preprocessor import PromptText
from dynamo.preprocess.tokenizer import Tokenizer

_Result = tuple["asyncio.Future[list[list[int]]]", list[list[int]] | None, Exception | None]


@dataclass(slots=True)
class _Job:
    tokenizer: Tokenizer
    prompts: Sequence[PromptText]
    future: asyncio.Future[list[list[int]]]


class EncodeThread:
    """One tokenizer thread (a daemon, started on first use); :meth:`close` at shutdown.

    ``batches`` and ``jobs`` count what the thread has encoded (a batch holds one or more jobs).
    """

    def __init__(self, name: str = "dynamo-tokenize") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.batches = 0
        self.jobs = 0

    async def encode(self, tokenizer: Tokenizer, prompts: Sequence[PromptText]) -> list[list[int]]:
        """The token ids of every prompt (in order), encoded on the thread. Raises what the
        tokenizer raised, or RuntimeError once closed. A cancelled caller's prompts are still
        encoded (the thread cannot be interrupted) and their result dropped."""
        future: asyncio.Future[list[list[int]]] = asyncio.get_running_loop().create_future()
        self.submit(tokenizer, prompts, future)
        return await future

    def submit(
        self,
        tokenizer: Tokenizer,
        prompts: Sequence[PromptText],
        future: asyncio.Future[list[list[int]]],
    ) -> None:
        """Encode ``prompts`` on the thread and answer ``future`` (on its loop) with their ids or
        the tokenizer's error; nothing if ``future`` is done by then. Raises RuntimeError once
        closed. For callers that already hold a future (``encode_process.py``'s fallback)."""
        if self._closed:
            raise RuntimeError("the tokenizer thread is closed")
        self._jobs.put(_Job(tokenizer, prompts, future))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread after the jobs already submitted (it does not wait for them)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        batch_policy()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch = [job]
            stop = False
            while True:  # everything that queued up meanwhile joins this batch
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            results = _encode(batch)
            self.batches += 1  # counted before the callers wake
            self.jobs += len(batch)
            _deliver(results)
            if stop:
                return


def batch_policy() -> bool:
    """Put the calling thread under ``SCHED_BATCH`` (Linux): the same CPU share as before, but its
    wake-ups no longer preempt a running thread. Lowering a thread's own policy needs no
    privilege; False where the platform has no such policy (the thread then runs as before)."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: this thread, on Linux
    except OSError:
        return False
    return True


def _encode(batch: list[_Job]) -> list[_Result]:
    """Every job's token ids (or the tokenizer's error): one ``encode_batch`` call per
    tokenizer and special-tokens flag."""
    groups: dict[tuple[int, bool], list[tuple[int, int, str]]] = {}
    tokenizers: dict[int, Tokenizer] = {}
    for j, job in enumerate(batch):
        tokenizers[id(job.tokenizer)] = job.tokenizer
        for p, prompt in enumerate(job.prompts):
            key = (id(job.tokenizer), prompt.add_special_tokens)
            groups.setdefault(key, []).append((j, p, prompt.text))
    ids: list[list[list[int]]] = [[[] for _ in job.prompts] for job in batch]
    errors: dict[int, Exception] = {}
    for (tokenizer_id, special), members in groups.items():
        tokenizer = tokenizers[tokenizer_id]
        try:
            encoded = tokenizer.encode_batch(
                [text for _, _, text in members], add_special_tokens=special
            )
        except Exception:
            # One prompt the tokenizer refuses must not fail the others batched with it:
            # encode them one by one, and only the refused prompt's job raises.
            for j, p, text in members:
                if j in errors:
                    continue
                try:
                    ids[j][p] = tokenizer.encode(text, add_special_tokens=special)
                except Exception as exc:  # the job's caller raises it
                    errors[j] = exc
            continue
        for (j, p, _), token_ids in zip(members, encoded, strict=True):
            ids[j][p] = token_ids
    return [
        (job.future, None, errors[j]) if j in errors else (job.future, ids[j], None)
        for j, job in enumerate(batch)
    ]


def _deliver(results: list[_Result]) -> None:
    """Hand the results to their loops: one wake-up per loop for the whole batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Result]] = {}
    for result in results:
        by_loop.setdefault(result[0].get_loop(), []).append(result)
    for loop, answers in by_loop.items():
        try:
            loop.call_soon_threadsafe(_answer, answers)
        except RuntimeError:  # that loop is closed: nobody waits any more
            pass


def _answer(results: list[_Result]) -> None:
    for future, token_ids, error in results:
        if future.done():  # the caller was cancelled
            continue
        if error is not None:
            future.set_exception(error)
        else:
            assert token_ids is not None
            future.set_result(token_ids)

"""CPU-heavy request work (JSON decoding, chat templating, tokenization) off the event loop.

A request whose body is small is decoded and templated inline: a thread hop costs more than the
work, and both hold the GIL anyway. Its tokenization runs, in batches, in the tokenizer process
(``preprocess/encode_process.py``) or on the tokenizer thread (``preprocess/encode_thread.py``;
``--tokenize-in``) whenever other requests are in flight, so that the loop serves them meanwhile;
alone, it runs inline too (the hop would only add its latency). A large request runs whole on
a small thread pool (the loop keeps serving meanwhile, but for the GIL-holding parts); a body
past ``PROCESS_ABOVE_BYTES`` is decoded in a helper process (``large_body.py``: msgspec holds
the GIL while it decodes, whatever the thread). Both sit behind one bounded queue: past
``max_pending`` large requests at once a new one is refused with :class:`Overloaded` rather
than queued without bound. A job counts as pending until its thread or
process is done with it, even when the request that asked for it was cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import multiprocessing
from collections.abc import Callable, Sequence
from typing import TypeVar

from dynamo.frontend.heap_trim import trim_heap
from dynamo.preprocess import Preprocessor, Prompt, PromptText
from dynamo.preprocess.encode_process import EncodeProcess
from dynamo.preprocess.encode_thread import EncodeThread
from dynamo.runtime.errors import Overloaded

T = TypeVar("T")

TOKENIZE_IN = ("process", "thread")
"""Where prompts of concurrent requests are tokenized: a child process (``encode_process.py``)
or a thread of this one (``encode_thread.py``)."""

INLINE_BELOW_BYTES = 64 * 1024
"""Bodies smaller than this are preprocessed on the event loop (well under a millisecond)."""
PROCESS_ABOVE_BYTES = 1024 * 1024
"""Bodies larger than this are decoded in the helper process (about 1 ms of GIL per MB saved)."""


class Offload:
    """Owned by the frontend service; :meth:`close` at shutdown. Single-loop use."""

    def __init__(
        self,
        threads: int = 2,
        max_pending: int = 16,
        inline_below_bytes: int = INLINE_BELOW_BYTES,
        tokenize_in: str = "thread",
    ) -> None:
        if threads < 1 or max_pending < 1:
            raise ValueError("offload threads and queue must be at least 1")
        if tokenize_in not in TOKENIZE_IN:
            raise ValueError(f"tokenize_in must be one of {TOKENIZE_IN}")
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "dynamo-preprocess")
        self._process: concurrent.futures.ProcessPoolExecutor | None = None  # on first use
        self._max_pending = max_pending
        self._inline_below = inline_below_bytes
        self.pending = 0
        self._trimming = False
        self.trims = 0
        self.encoder: EncodeProcess | EncodeThread = (
            EncodeProcess() if tokenize_in == "process" else EncodeThread()
        )

    def inline(self, size: int) -> bool:
        """Whether a request of ``size`` bytes is preprocessed on the loop (:meth:`run`)."""
        return size < self._inline_below

    async def encode(
        self, preprocessor: Preprocessor, prompts: Sequence[Prompt], *, inline: bool
    ) -> list[list[int]]:
        """The token ids of every prompt: here when ``inline`` (or nothing is text), else on the
        tokenizer process or thread. Not counted as pending: a small prompt's tokenization is
        short."""
        texts = [p for p in prompts if isinstance(p, PromptText)]
        if inline or not texts:
            return preprocessor.encode(prompts)
        encoded = iter(await self.encoder.encode(preprocessor.tokenizer, texts))
        return [p if isinstance(p, list) else next(encoded) for p in prompts]

    async def run(self, size: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``: inline when ``size`` (the request's bytes) is small, else on the pool."""
        if self.inline(size):
            return fn(*args)
        return await self._submit(self._pool, functools.partial(fn, *args))

    async def run_in_process(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the helper process (``fn`` and the arguments must pickle)."""
        if self._process is None:
            # spawn: a fork of this process would copy its threads' locks mid-use
            context = multiprocessing.get_context("spawn")
            self._process = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
        return await self._submit(self._process, functools.partial(fn, *args))

    async def _submit(self, pool: concurrent.futures.Executor, job_fn: Callable[[], T]) -> T:
        if self.pending >= self._max_pending:
            raise Overloaded("too many large requests are being preprocessed; retry later")
        loop = asyncio.get_running_loop()
        job = pool.submit(job_fn)
        self.pending += 1
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return await asyncio.wrap_future(job)

    def _done(self) -> None:
        self.pending -= 1

    def trim_memory(self) -> None:
        """Give the allocators' free pages back to the system, on the pool (after a large
        request: ``heap_trim.py``). One trim at a time; a request for one meanwhile is merged
        into it. Fire and forget: nothing waits for it, and it is not a pending job."""
        if self._trimming:
            return
        loop = asyncio.get_running_loop()
        try:
            job = self._pool.submit(trim_heap)
        except RuntimeError:  # closed: the process is stopping
            return
        self._trimming = True
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._trimmed))

    def _trimmed(self) -> None:
        self._trimming = False
        self.trims += 1

    def close(self) -> None:
        self.encoder.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._process is not None:
            self._process.shutdown(wait=False, cancel_futures=True)
            self._process = None

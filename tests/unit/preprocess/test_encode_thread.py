"""The tokenizer thread: the same ids as inline encoding, prompts that queue up while it works
encoded as one batch, errors and cancellations confined to their own caller."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence

import pytest

from dynamo.preprocess import ModelDir, PromptText, Tokenizer
from dynamo.preprocess.encode_thread import EncodeThread

pytestmark = pytest.mark.unit


class GatedTokenizer(Tokenizer):
    """The demo tokenizer, whose first ``encode_batch`` call waits for ``gate`` (so that the
    next jobs queue up behind it); texts containing ``poison`` raise."""

    __slots__ = ("gate", "entered", "calls")

    def __init__(self, base: Tokenizer) -> None:
        super().__init__(base.raw)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[int] = []

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        self.calls.append(len(texts))
        self.entered.set()
        self.gate.wait(10)
        if any("poison" in text for text in texts):
            raise ValueError("poisoned text")
        return super().encode_batch(texts, add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if "poison" in text:
            raise ValueError("poisoned text")
        return super().encode(text, add_special_tokens)


async def test_queued_prompts_are_one_batch_with_inline_ids(demo_model: ModelDir) -> None:
    base = demo_model.tokenizer
    tok = GatedTokenizer(base)
    thread = EncodeThread()
    try:
        first = asyncio.ensure_future(thread.encode(tok, [PromptText("warm up", False)]))
        await asyncio.to_thread(tok.entered.wait, 10)  # the thread is busy with the first job
        texts = [("hello world", False), ("the quick brown fox", True), ("jumps", False)]
        queued = [
            asyncio.ensure_future(thread.encode(tok, [PromptText(text, special)]))
            for text, special in texts
        ]
        pair = asyncio.ensure_future(
            thread.encode(tok, [PromptText("a", False), PromptText("b c", False)])
        )
        await asyncio.sleep(0.05)
        tok.gate.set()
        assert await first == [base.encode("warm up")]
        for job, (text, special) in zip(queued, texts, strict=True):
            assert await job == [base.encode(text, add_special_tokens=special)]
        assert await pair == [base.encode("a"), base.encode("b c")]
        # the first job alone, then everything queued meanwhile: one call per special flag
        assert thread.batches == 2 and thread.jobs == 5
        assert tok.calls == [1, 4, 1]
    finally:
        thread.close()


async def test_an_error_or_a_cancellation_stays_with_its_caller(demo_model: ModelDir) -> None:
    base = demo_model.tokenizer
    tok = GatedTokenizer(base)
    healthy = GatedTokenizer(base)
    healthy.gate.set()
    thread = EncodeThread()
    try:
        blocker = asyncio.ensure_future(thread.encode(tok, [PromptText("first", False)]))
        await asyncio.to_thread(tok.entered.wait, 10)
        poisoned = asyncio.ensure_future(thread.encode(tok, [PromptText("poison", False)]))
        good = asyncio.ensure_future(thread.encode(healthy, [PromptText("fine", False)]))
        cancelled = asyncio.ensure_future(thread.encode(healthy, [PromptText("gone", False)]))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        tok.gate.set()
        assert await blocker == [base.encode("first")]
        with pytest.raises(ValueError, match="poisoned"):
            await poisoned
        assert await good == [base.encode("fine")]
        assert cancelled.cancelled()
        # the thread goes on serving
        assert await thread.encode(healthy, [PromptText("again", False)]) == [base.encode("again")]
    finally:
        thread.close()
    with pytest.raises(RuntimeError, match="closed"):
        await thread.encode(healthy, [PromptText("late", False)])


async def test_a_refused_prompt_does_not_fail_the_prompts_batched_with_it(
    demo_model: ModelDir,
) -> None:
    base = demo_model.tokenizer
    tok = GatedTokenizer(base)
    thread = EncodeThread()
    try:
        blocker = asyncio.ensure_future(thread.encode(tok, [PromptText("first", False)]))
        await asyncio.to_thread(tok.entered.wait, 10)
        # the same tokenizer and flag: one encode_batch call for both, which raises
        poisoned = asyncio.ensure_future(thread.encode(tok, [PromptText("poison", False)]))
        good = asyncio.ensure_future(thread.encode(tok, [PromptText("fine words", False)]))
        await asyncio.sleep(0.05)
        tok.gate.set()
        assert await blocker == [base.encode("first")]
        with pytest.raises(ValueError, match="poisoned"):
            await poisoned
        assert await good == [base.encode("fine words")]
        assert tok.calls == [1, 2]  # batched together, then retried one by one
    finally:
        thread.close()


class PolicyTokenizer(Tokenizer):
    """The demo tokenizer, noting the scheduling policy of the thread that encodes."""

    __slots__ = ("policies",)

    def __init__(self, base: Tokenizer) -> None:
        super().__init__(base.raw)
        self.policies: list[int] = []

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        self.policies.append(os.sched_getscheduler(0))
        return super().encode_batch(texts, add_special_tokens)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
async def test_the_thread_runs_as_a_batch_thread_and_the_caller_does_not(
    demo_model: ModelDir,
) -> None:
    """Its wake-ups must not preempt the event loop's thread (which holds the GIL it needs)."""
    tok = PolicyTokenizer(demo_model.tokenizer)
    thread = EncodeThread()
    try:
        ids = await thread.encode(tok, [PromptText("hello world", False)])
        assert ids == [demo_model.tokenizer.encode("hello world")]
        assert tok.policies == [os.SCHED_BATCH]
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the loop's thread is untouched
    finally:
        thread.close()

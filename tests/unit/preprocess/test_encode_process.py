"""The tokenizer process: the same ids as in-process encoding (several tokenizers, special
tokens), a killed or silent child replaced without losing a prompt, errors and cancellations
confined to their caller, large batches across the socket in pieces, no process left behind."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dynamo.preprocess import ModelDir, PromptText, Tokenizer
from dynamo.preprocess.encode_process import EncodeProcess

pytestmark = pytest.mark.unit

TEXTS = [
    "Hello, world!",
    "The router sends each request to the worker with the longest cached prefix.",
    "Café crème, naïve résumé, Straße, 你好世界, 日本語, emoji 🦄🚀👋🏽",
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<s> a special token in the text </s>",
    "",
    "   leading and trailing spaces   ",
]


def trained_tokenizer() -> Tokenizer:
    """A byte-level BPE trained here, with special tokens and a post-processor that adds one."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator([" ".join(TEXTS)] * 20, trainer)
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
    )
    return Tokenizer(raw)


def strict_tokenizer() -> Tokenizer:
    """A word-level tokenizer without an unknown token: it refuses any other word."""
    raw = RawTokenizer(models.WordLevel({"hello": 0, "world": 1}, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(raw)


def prompts(texts: Sequence[str], special: bool) -> list[PromptText]:
    return [PromptText(text, special) for text in texts]


def alive(pid: int | None) -> bool:
    """Whether ``pid`` is a process (a zombie, killed but not reaped, counts)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_the_ids_are_those_of_in_process_encoding_for_several_tokenizers(
    demo_model: ModelDir,
) -> None:
    demo, trained = demo_model.tokenizer, trained_tokenizer()
    encoder = EncodeProcess()
    try:
        cases = [
            (tok, text, special)
            for tok in (demo, trained)
            for text in TEXTS
            for special in (False, True)
        ]
        results = await asyncio.gather(
            *(encoder.encode(tok, [PromptText(text, special)]) for tok, text, special in cases),
            encoder.encode(trained, prompts(TEXTS, True)),  # one job of several prompts
        )
        expected = [[tok.encode(text, special)] for tok, text, special in cases]
        assert results == [*expected, [trained.encode(text, True) for text in TEXTS]]
        assert trained.encode("x", True)[0] == trained.token_to_id("<s>")  # the flag mattered
        # submitted in one loop iteration: one batch, both tokenizers loaded once
        assert encoder.batches == 1 and encoder.jobs == len(cases) + 1
        assert encoder.fallback_jobs == 0 and encoder.starts == 1
        assert encoder.tokenizers_loaded == 2
        again = await encoder.encode(demo, prompts(TEXTS[:2], False))
        assert again == [demo.encode(text) for text in TEXTS[:2]]
        assert encoder.batches == 2 and encoder.tokenizers_loaded == 2
    finally:
        encoder.close()


async def test_a_killed_child_has_its_batch_encoded_here_and_is_restarted(
    demo_model: ModelDir,
) -> None:
    tok = demo_model.tokenizer
    encoder = EncodeProcess(backoff_s=(0.01, 0.05))
    try:
        assert await encoder.encode(tok, prompts(["warm up"], False)) == [tok.encode("warm up")]
        first = encoder.pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)  # so that the next batch stays in flight
        jobs = [asyncio.ensure_future(encoder.encode(tok, prompts([t], False))) for t in TEXTS]
        while encoder.in_flight < len(TEXTS):
            await asyncio.sleep(0.001)
        os.kill(first, signal.SIGKILL)
        assert await asyncio.gather(*jobs) == [[tok.encode(t)] for t in TEXTS]
        assert encoder.fallback_jobs == len(TEXTS) and encoder.pid is None
        await asyncio.sleep(0.1)  # past the backoff: the next batch starts a new child
        assert await encoder.encode(tok, prompts(["after"], True)) == [tok.encode("after", True)]
        assert encoder.starts == 2 and encoder.pid not in (None, first)
        second = encoder.pid
    finally:
        encoder.close()
    assert not alive(first) and not alive(second)  # killed, and reaped at the latest by close


async def test_a_silent_child_is_replaced_after_the_reply_timeout(demo_model: ModelDir) -> None:
    tok = demo_model.tokenizer
    encoder = EncodeProcess(reply_timeout_s=0.2, backoff_s=(0.01, 0.05))
    try:
        # a child that answers (on a very slow machine a first one may have been timed out)
        while encoder.pid is None:
            assert await encoder.encode(tok, prompts(["warm up"], False)) == [tok.encode("warm up")]
            await asyncio.sleep(0.02)
        stopped, answered_here, starts = encoder.pid, encoder.fallback_jobs, encoder.starts
        os.kill(stopped, signal.SIGSTOP)
        assert await encoder.encode(tok, prompts(["hello"], False)) == [tok.encode("hello")]
        assert encoder.fallback_jobs == answered_here + 1 and encoder.pid is None
        await asyncio.sleep(0.1)
        assert await encoder.encode(tok, prompts(["again"], False)) == [tok.encode("again")]
        assert encoder.starts == starts + 1
    finally:
        encoder.close()
    assert not alive(stopped)  # SIGKILL ends a stopped process too


async def test_an_encode_error_fails_only_its_own_caller(demo_model: ModelDir) -> None:
    demo, strict = demo_model.tokenizer, strict_tokenizer()
    with pytest.raises(Exception, match="Missing") as in_process:
        strict.encode("hello moon")
    encoder = EncodeProcess()
    try:
        refused, good, other = await asyncio.gather(
            encoder.encode(strict, prompts(["hello moon"], False)),
            encoder.encode(strict, prompts(["world hello"], False)),
            encoder.encode(demo, prompts(["fine"], False)),
            return_exceptions=True,
        )
        assert type(refused) is type(in_process.value) and str(refused) == str(in_process.value)
        assert good == [[1, 0]] and other == [demo.encode("fine")]
        assert encoder.batches == 1 and encoder.fallback_jobs == 1  # the refused one, here
        # a text msgspec cannot carry (a lone surrogate): its batch is encoded here, the same way
        with pytest.raises(TypeError) as surrogate_here:
            demo.encode("bad \ud800")
        bad, fine = await asyncio.gather(
            encoder.encode(demo, prompts(["bad \ud800"], False)),
            encoder.encode(demo, prompts(["still fine"], False)),
            return_exceptions=True,
        )
        assert type(bad) is TypeError and str(bad) == str(surrogate_here.value)
        assert fine == [demo.encode("still fine")]
        assert encoder.starts == 1  # the child was never at fault
        assert await encoder.encode(demo, prompts(["next"], False)) == [demo.encode("next")]
    finally:
        encoder.close()


async def test_a_cancelled_caller_is_not_sent(demo_model: ModelDir) -> None:
    tok = demo_model.tokenizer
    encoder = EncodeProcess()
    try:
        jobs = [asyncio.ensure_future(encoder.encode(tok, prompts([t], False))) for t in TEXTS[:3]]
        await asyncio.sleep(0)  # submitted, not yet sent
        jobs[1].cancel()
        assert await jobs[0] == [tok.encode(TEXTS[0])]
        assert await jobs[2] == [tok.encode(TEXTS[2])]
        assert jobs[1].cancelled() and encoder.jobs == 2
    finally:
        encoder.close()


async def test_large_batches_cross_the_socket_in_pieces(demo_model: ModelDir) -> None:
    """Texts and replies far larger than a socket buffer, in batches bounded by characters."""
    tok = demo_model.tokenizer
    texts = [f"{i} the quick brown fox jumps over the lazy dog " * 4000 for i in range(4)]
    encoder = EncodeProcess(max_batch_chars=400_000)
    try:
        results = await asyncio.gather(*(encoder.encode(tok, prompts([t], False)) for t in texts))
        assert results == [[tok.encode(t)] for t in texts]
        assert encoder.batches == 2 and encoder.fallback_jobs == 0
    finally:
        encoder.close()


async def test_a_collected_tokenizer_is_dropped_by_the_child(demo_model: ModelDir) -> None:
    encoder = EncodeProcess()
    try:
        trained = trained_tokenizer()
        assert await encoder.encode(trained, prompts(["hello"], False)) == [trained.encode("hello")]
        assert encoder.tokenizers_loaded == 1
        del trained
        gc.collect()
        tok = demo_model.tokenizer
        assert await encoder.encode(tok, prompts(["hello"], False)) == [tok.encode("hello")]
        assert encoder.tokenizers_loaded == 1  # the demo's, the other one dropped
    finally:
        encoder.close()


async def test_close_leaves_no_process(demo_model: ModelDir) -> None:
    tok = demo_model.tokenizer
    encoder = EncodeProcess()
    await encoder.encode(tok, prompts(["hello"], False))
    pid = encoder.pid
    assert pid is not None and alive(pid)
    encoder.close()
    assert not alive(pid) and encoder.pid is None
    with pytest.raises(RuntimeError, match="closed"):
        await encoder.encode(tok, prompts(["late"], False))

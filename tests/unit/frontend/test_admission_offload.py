"""Load shedding's arithmetic (capacity from the cards, Retry-After from the drain rate, one
release per ticket), the preprocessing offload's bounded queue and where it tokenizes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dynamo.frontend.admission import MAX_RETRY_AFTER_S, Admission, Shed
from dynamo.frontend.config import FrontendConfig
from dynamo.frontend.errors import to_http
from dynamo.frontend.offload import TOKENIZE_IN, Offload
from dynamo.preprocess import Preprocessor, demo_model_path, load_model_dir
from dynamo.preprocess.encode_process import EncodeProcess
from dynamo.preprocess.encode_thread import EncodeThread
from dynamo.protocol.model_card import ModelCard
from dynamo.runtime.errors import Overloaded
from tests.fakes import make_card

pytestmark = pytest.mark.unit


def card(max_num_seqs: int | None) -> ModelCard:
    return make_card(1, model_path="demo", max_num_seqs=max_num_seqs)


def test_capacity_is_factor_times_the_advertised_slots() -> None:
    admission = Admission(factor=1.5)
    cards = [card(2), card(2)]
    tickets = [admission.admit("m", cards) for _ in range(6)]  # floor(4 * 1.5)
    with pytest.raises(Shed) as refused:
        admission.admit("m", cards)
    assert 1 <= refused.value.retry_after_s <= MAX_RETRY_AFTER_S
    reply = to_http(refused.value, 529)
    assert reply.status == 529
    assert ("retry-after", str(refused.value.retry_after_s)) in reply.headers
    tickets[0].release()
    tickets[0].release()  # idempotent: frees one place, not two
    assert admission.admitted("m") == 5
    admission.admit("m", cards)
    with pytest.raises(Shed):
        admission.admit("m", cards)


def test_unadvertised_capacity_and_factor_zero_never_shed() -> None:
    for admission, cards in ((Admission(), [card(1), card(None)]), (Admission(0), [card(1)])):
        for _ in range(50):
            admission.admit("m", cards)


def test_retry_after_follows_the_drain_rate() -> None:
    admission = Admission(factor=1.0, window_s=10.0)
    cards = [card(1)]
    admission.admit("m", cards)
    with pytest.raises(Shed) as idle:
        admission.admit("m", cards)
    assert idle.value.retry_after_s == 10  # nothing finished lately: one window
    fast = Admission(factor=1.0)
    for _ in range(200):  # many quick finishes: a high drain rate
        fast.admit("m", cards).release()
    fast.admit("m", cards)
    with pytest.raises(Shed) as busy:
        fast.admit("m", cards)
    assert busy.value.retry_after_s == 1


async def test_offload_runs_small_inline_and_bounds_large() -> None:
    offload = Offload(threads=1, max_pending=2, inline_below_bytes=100)
    try:
        main = threading.get_ident()
        assert await offload.run(10, threading.get_ident) == main
        assert await offload.run(1000, threading.get_ident) != main
        gate = threading.Event()
        jobs = [asyncio.ensure_future(offload.run(1000, gate.wait, 5)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded):
            await offload.run(1000, threading.get_ident)
        jobs[0].cancel()  # a cancelled job's thread still counts until it is done
        await asyncio.sleep(0.05)
        assert offload.pending == 2
        gate.set()
        await asyncio.gather(*jobs, return_exceptions=True)
        async with asyncio.timeout(5):
            while offload.pending:
                await asyncio.sleep(0.01)
    finally:
        offload.close()


async def test_trim_memory_runs_on_the_pool_once_at_a_time() -> None:
    offload = Offload(threads=1)
    offload.trim_memory()
    offload.trim_memory()  # merged into the one in flight
    async with asyncio.timeout(10):
        while offload.trims == 0:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert offload.trims == 1 and offload.pending == 0
    offload.close()
    offload.trim_memory()  # after close: nothing, no error
    assert offload.trims == 1


@pytest.mark.parametrize("tokenize_in", TOKENIZE_IN)
async def test_encode_inline_alone_and_in_the_tokenizer_process_or_thread_when_busy(
    tokenize_in: str,
) -> None:
    pre = Preprocessor(load_model_dir(demo_model_path()), served_model_name="demo")
    prompts = pre.completion_prompts(["hello world", "the end"])
    ids_prompt = pre.completion_prompts([1, 2, 3])
    offload = Offload(threads=1, tokenize_in=tokenize_in)
    kind = EncodeProcess if tokenize_in == "process" else EncodeThread
    assert isinstance(offload.encoder, kind)
    try:
        inline = await offload.encode(pre, prompts, inline=True)
        assert offload.encoder.jobs == 0
        assert await offload.encode(pre, prompts, inline=False) == inline == pre.encode(prompts)
        assert offload.encoder.jobs == 1
        # token ids pass through without a trip to the process or thread
        assert await offload.encode(pre, ids_prompt, inline=False) == [[1, 2, 3]]
        assert offload.encoder.jobs == 1
    finally:
        offload.close()


def test_tokenize_in_flag_its_env_twin_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    def parsed(*argv: str) -> FrontendConfig:
        return FrontendConfig.from_args(FrontendConfig.build_parser().parse_args(list(argv)))

    monkeypatch.delenv("DYN_TOKENIZE_IN", raising=False)
    assert parsed().tokenize_in == "process"
    assert parsed("--tokenize-in", "thread").tokenize_in == "thread"
    monkeypatch.setenv("DYN_TOKENIZE_IN", "thread")
    assert parsed().tokenize_in == "thread"
    with pytest.raises(ValueError, match="tokenize"):
        FrontendConfig(tokenize_in="elsewhere")
    with pytest.raises(ValueError, match="tokenize_in"):
        Offload(tokenize_in="elsewhere")

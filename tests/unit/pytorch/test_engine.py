"""TorchEngine without HTTP: sampling, logprobs, cancellation, block accounting against the
router's index, KV export/import, the conformance kit, bad input."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from dynamo.backend.testing import check_engine
from dynamo.protocol.kv_events import KVEventBatch
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import (
    GuidedDecodingOptions,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo.pytorch.config import TorchEngineConfig
from dynamo.pytorch.engine import TorchEngine
from dynamo.router.hashing import local_block_hashes
from dynamo.router.indexer import EventStatus, KVIndexer
from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument
from tests.tiny_models import TEST_DEVICE, hf_greedy, hf_prompt_logprobs

BS = 16


def engine(model: Path, **kw: object) -> TorchEngine:
    cfg: dict[str, object] = {
        "model_path": str(model),
        "block_size": BS,
        "num_gpu_blocks_override": 64,
        "max_num_batched_tokens": 96,
        "device": TEST_DEVICE,
    }
    cfg.update(kw)
    return TorchEngine(TorchEngineConfig(**cfg))  # type: ignore[arg-type]


def request_for(
    tokens: list[int], max_tokens: int = 6, *, seed: int | None = None, **sampling: object
) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="tiny",
        token_ids=tokens,
        sampling=SamplingOptions(seed=seed, **sampling),  # type: ignore[arg-type]
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


async def run(eng: TorchEngine, req: PreprocessedRequest) -> list[LLMEngineOutput]:
    return [out async for out in eng.generate(req, Context())]


def ids(chunks: list[LLMEngineOutput]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def test_seeded_sampling_is_reproducible_and_seeds_differ(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    await eng.start(1)
    try:
        prompt = list(range(10, 40))
        kw = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.01}
        a = ids(await run(eng, request_for(prompt, 12, seed=7, **kw)))
        # The same seed again, now batched with other requests: the same tokens.
        others = [run(eng, request_for(list(range(50, 50 + n)), 8, seed=n)) for n in (5, 9, 30)]
        b, *_ = await asyncio.gather(run(eng, request_for(prompt, 12, seed=7, **kw)), *others)
        c = ids(await run(eng, request_for(prompt, 12, seed=8, **kw)))
        assert a == ids(b) and a != c
    finally:
        await eng.cleanup()


async def test_logprobs_are_those_of_the_raw_model(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    await eng.start(1)
    try:
        req = request_for(list(range(3, 20)), 5, temperature=0.0)
        req.output = OutputOptions(logprobs=3)
        chunks = await run(eng, req)
        lps = [lp for c in chunks for lp in (c.log_probs or [])]
        tops = [t for c in chunks for t in (c.top_logprobs or [])]
        tokens = ids(chunks)
        assert len(lps) == len(tops) == len(tokens) == 5
        for token, lp, top in zip(tokens, lps, tops, strict=True):
            assert len(top) == 3 and top[0].token_id == token  # greedy: the most likely
            assert lp == pytest.approx(top[0].logprob) and lp <= 0.0
            assert top[0].logprob >= top[1].logprob >= top[2].logprob
    finally:
        await eng.cleanup()


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_mistral", "tiny_llama31"])
async def test_greedy_matches_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    model: Path = request.getfixturevalue(arch)
    eng = engine(model, max_num_batched_tokens=32)  # chunked prefill of a 70-token prompt
    await eng.start(1)
    try:
        prompt = [(i * 7) % 300 + 5 for i in range(70)]
        got = ids(await run(eng, request_for(prompt, 10, temperature=0.0)))
        assert got == hf_greedy(model, prompt, 10)
    finally:
        await eng.cleanup()


async def test_bfloat16_runs(tiny_llama: Path) -> None:
    eng = engine(tiny_llama, dtype="bfloat16")
    await eng.start(1)
    try:
        blocks = eng.loaded.cache.layout if eng.loaded else None
        assert blocks is not None and blocks.dtype == "bfloat16"
        prompt = list(range(5, 45))
        out = await run(eng, request_for(prompt, 8, temperature=0.0))
        assert len(ids(out)) == 8 and out[-1].finish_reason is FinishReason.LENGTH
        # Close to fp32: the first greedy token agrees (logit margins are wide at init 0.2).
        assert ids(out)[0] == hf_greedy(tiny_llama, prompt, 1)[0]
    finally:
        await eng.cleanup()


async def test_stop_token_ids_and_min_tokens(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    await eng.start(1)
    try:
        prompt = list(range(5, 25))
        plain = ids(await run(eng, request_for(prompt, 16, temperature=0.0)))
        # min_tokens bans the stop ids until reached: stop on the greedy first token otherwise.
        first = plain[0]
        req = request_for(prompt, 8, temperature=0.0)
        req.stop = StopConditions(max_tokens=8, stop_token_ids=[first], ignore_eos=True)
        assert ids(await run(eng, req)) == [first]
        req.stop = StopConditions(
            max_tokens=8, min_tokens=3, stop_token_ids=[first], ignore_eos=True
        )
        out = ids(await run(eng, req))
        assert first not in out[:3] and len(out) >= 3
    finally:
        await eng.cleanup()


async def test_bad_requests_are_invalid_arguments(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    await eng.start(1)
    try:
        bad = [
            request_for([1, 2, 10_000]),  # beyond the vocabulary
            request_for(list(range(10)), 10_000),  # beyond the context length
            request_for([1, 2, 3], top_p=0.0),
            request_for([1, 2, 3], temperature=-1.0),
            request_for([1, 2, 3], guided_decoding=GuidedDecodingOptions(regex="(a")),
            request_for([1, 2, 3], guided_decoding=GuidedDecodingOptions(choice=[])),
        ]
        for req in bad:
            with pytest.raises(InvalidArgument):
                await run(eng, req)
        assert eng.capabilities.logprobs and eng.capabilities.guided_decoding
        await eng.check_invariants()
    finally:
        await eng.cleanup()


async def test_many_requests_with_cancellations_free_every_block(tiny_llama: Path) -> None:
    """1,000 short requests (shared and unique prefixes, a third cancelled mid-stream): every
    block is free afterwards and the router's index, fed by the events, holds exactly the
    engine's cached blocks."""
    index = KVIndexer()
    statuses: list[EventStatus] = []

    async def sink(batch: KVEventBatch) -> None:
        statuses.extend(index.apply(batch.worker_id, e) for e in batch.events)

    eng = engine(tiny_llama, num_gpu_blocks_override=40, max_num_seqs=32)
    eng.kv_event_sink = sink
    await eng.start(7)
    rng = random.Random(0)
    prefixes = [[rng.randrange(5, 390) for _ in range(2 * BS)] for _ in range(6)]

    async def one(i: int) -> None:
        tokens = prefixes[i % 6][: rng.randrange(4, 2 * BS)] + [rng.randrange(5, 390)] * (i % 5)
        ctx = Context()
        n = 0
        async for out in eng.generate(request_for(tokens, rng.randrange(1, 6)), ctx):
            n += len(out.token_ids)
            if i % 3 == 0 and n >= 1:
                ctx.stop_generating()
            if out.finish_reason is not None:
                return

    try:
        sem = asyncio.Semaphore(48)

        async def bounded(i: int) -> None:
            async with sem:
                await one(i)

        await asyncio.gather(*(bounded(i) for i in range(1000)))
        await asyncio.sleep(0.05)
        await eng.check_invariants()
        sched = eng.scheduler
        assert sched is not None and not sched.has_work
        assert sched.kv.num_active_blocks == 0  # every block free (or cached, evictable)
        for _ in range(50):  # the last pass's events are on their way to the sink
            if index.num_blocks(7) == len(sched.kv.cached_blocks()):
                break
            await asyncio.sleep(0.02)
        assert set(statuses) == {EventStatus.OK}
        assert index.num_blocks(7) == len(sched.kv.cached_blocks()) > 0
        stats = eng.stats
        assert stats is not None and stats.num_cached_tokens > 0
    finally:
        await eng.cleanup()


async def test_exported_blocks_make_a_prefix_hit_elsewhere(tiny_llama: Path) -> None:
    a, b = engine(tiny_llama), engine(tiny_llama)
    await a.start(1)
    await b.start(2)
    try:
        prompt = list(range(20, 20 + 3 * BS + 5))
        ref = await run(a, request_for(prompt, 6, temperature=0.0))
        local = local_block_hashes(prompt, BS)
        sched = a.scheduler
        assert sched is not None
        hashes = [h for h in sched.kv.cached_blocks()]
        # The prompt's chain, in order (what a disaggregated handoff names).
        from dynamo.router.hashing import sequence_hashes

        chain = sequence_hashes(local)
        assert set(chain) <= set(hashes)
        blocks = await a.export_kv(chain)
        assert blocks.block_hashes == chain and blocks.local_hashes == local
        assert await b.import_kv(blocks) == 3
        assert await b.import_kv(blocks) == 0  # already cached
        out = await run(b, request_for(prompt, 6, temperature=0.0))
        assert ids(out) == ids(ref)
        assert out[-1].usage is not None and out[-1].usage.cached_tokens == 3 * BS
    finally:
        await a.cleanup()
        await b.cleanup()


async def test_conformance_kit(tiny_llama: Path) -> None:
    report = await check_engine(lambda: engine(tiny_llama), long_tokens=400)
    assert report.ok, report.failures


async def test_cancelled_stream_ends_cancelled_and_frees_blocks(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    await eng.start(1)
    try:
        ctx = Context()
        chunks = []
        async for out in eng.generate(request_for(list(range(5, 60)), 300), ctx):
            chunks.append(out)
            if len(chunks) == 2:
                await eng.abort(ctx)
        assert chunks[-1].finish_reason is FinishReason.CANCELLED
        await eng.check_invariants()
        sched = eng.scheduler
        assert sched is not None and sched.kv.num_active_blocks == 0
    finally:
        await eng.cleanup()


async def test_preempted_requests_recompute_and_still_match_transformers(
    tiny_llama: Path,
) -> None:
    """A pool too small for four 70-token sequences: decodes preempt (LIFO) and the victims
    recompute their KV later; every output still equals transformers'."""
    eng = engine(tiny_llama, num_gpu_blocks_override=12, max_num_batched_tokens=256)
    await eng.start(1)
    try:
        prompts = [[(i * 31 + j * 7) % 380 + 5 for j in range(40)] for i in range(4)]
        outs = await asyncio.gather(
            *(run(eng, request_for(p, 30, temperature=0.0)) for p in prompts)
        )
        for p, out in zip(prompts, outs, strict=True):
            assert ids(out) == hf_greedy(tiny_llama, p, 30)
        stats = eng.stats
        assert stats is not None and stats.num_preemptions > 0
        await eng.check_invariants()
    finally:
        await eng.cleanup()


async def test_guided_decoding_seam(tiny_llama: Path) -> None:
    """A constraint from the factory masks every sampled row and hears every emitted token."""

    class EvenTokens:
        def __init__(self, options: GuidedDecodingOptions) -> None:
            assert options.regex == "[02468]+"
            self.accepted: list[int] = []

        def mask_logits(self, logits: torch.Tensor) -> None:
            logits[1::2] = float("-inf")

        def accept_token(self, token_id: int) -> None:
            self.accepted.append(token_id)

        def is_terminated(self) -> bool:
            return False

    made: list[EvenTokens] = []

    async def factory(options: GuidedDecodingOptions) -> EvenTokens:
        made.append(EvenTokens(options))
        return made[-1]

    eng = TorchEngine(
        TorchEngineConfig(
            model_path=str(tiny_llama), num_gpu_blocks_override=64, device=TEST_DEVICE
        ),
        constraint_factory=factory,
    )
    await eng.start(1)
    try:
        assert eng.capabilities.guided_decoding
        req = request_for(list(range(5, 30)), 10, seed=3, temperature=1.0)
        req.sampling.guided_decoding = GuidedDecodingOptions(regex="[02468]+")
        tokens = ids(await run(eng, req))
        assert len(tokens) == 10 and all(t % 2 == 0 for t in tokens)
        assert made[0].accepted == tokens
    finally:
        await eng.cleanup()


async def test_guided_request_stops_when_its_grammar_is_complete(tiny_llama: Path) -> None:
    """The model's own llguidance decoder: a choice ends the request as soon as it is complete
    (finish reason stop, even with ignore_eos and room left); its blocks are freed."""
    from dynamo.preprocess import load_model_dir

    tokenizer = load_model_dir(tiny_llama).tokenizer
    eng = engine(tiny_llama)
    await eng.start(1)
    try:
        choices = ["Paris", "the lazy dog", "0 1 2"]
        for seed in range(6):
            req = request_for(list(range(5, 30)), 40, seed=seed, temperature=1.0)
            req.sampling.guided_decoding = GuidedDecodingOptions(choice=choices)
            chunks = await run(eng, req)
            assert chunks[-1].finish_reason is FinishReason.STOP
            assert tokenizer.decode(ids(chunks)) in choices
        sched = eng.scheduler
        assert sched is not None and sched.kv.num_active_blocks == 0
        await eng.check_invariants()
    finally:
        await eng.cleanup()


async def test_prompt_logprobs_cover_the_whole_prompt_even_when_cached(tiny_llama: Path) -> None:
    eng = engine(tiny_llama, max_num_batched_tokens=32)  # chunked: 3 passes for 70 tokens
    await eng.start(1)
    try:
        prompt = [(i * 13) % 380 + 5 for i in range(70)]
        await run(eng, request_for(prompt, 2, temperature=0.0))  # now the prompt is cached
        req = request_for(prompt, 3, temperature=0.0)
        req.output = OutputOptions(prompt_logprobs=0)
        chunks = await run(eng, req)
        got = chunks[0].prompt_logprobs
        assert got is not None and got[0] is None and len(got) == len(prompt)
        assert all(c.prompt_logprobs is None for c in chunks[1:])
        expected = hf_prompt_logprobs(tiny_llama, prompt)
        assert got[1:] == pytest.approx(expected, abs=1e-4)
        usage = chunks[-1].usage
        assert usage is not None and usage.cached_tokens == 0  # computed, not reused
        assert eng.capabilities.prompt_logprobs
    finally:
        await eng.cleanup()


def test_blocks_convert_to_another_block_size() -> None:
    """A prefill worker's blocks of 32 tokens re-laid as 16-token blocks: the same K/V per
    token, named by the 16-token hashes of the prompt."""
    from dynamo.pytorch.kv_cache import KVCache, KVLayout, contiguous_runs, convert_blocks
    from dynamo.router.hashing import sequence_hashes

    assert contiguous_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    big = KVLayout(num_layers=2, block_size=32, num_kv_heads=2, head_dim=4, dtype="float32")
    small = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=4, dtype="float32")
    src = KVCache.allocate(big, 8, torch.device("cpu"))
    dst = KVCache.allocate(small, 16, torch.device("cpu"))
    for k, v in src.pools:
        k.normal_()
        v.normal_()
    tokens = list(range(100, 180))  # 80 tokens: two 32-token blocks (64 tokens) received
    from dynamo.pytorch.kv_cache import KVBlocks

    received = KVBlocks(
        layout=big, block_hashes=[1, 2], local_hashes=[1, 2], data=src.export_slots([5, 6])
    )
    blocks = convert_blocks(received, small, tokens)
    local = local_block_hashes(tokens[:64], 16)
    assert blocks.block_hashes == sequence_hashes(local) and len(local) == 4
    dst.import_slots([0, 1, 2, 3], blocks.data)
    for (sk, sv), (dk, dv) in zip(src.pools, dst.pools, strict=True):
        for s, d in ((sk, dk), (sv, dv)):
            want = s[:, 5:7].reshape(2, 64, 4)  # [heads, tokens, dim]
            assert torch.equal(d[:, 0:4].reshape(2, 64, 4), want)
    other = KVLayout(num_layers=3, block_size=16, num_kv_heads=2, head_dim=4, dtype="float32")
    with pytest.raises(ValueError, match="cannot be converted"):
        convert_blocks(received, other, tokens)


def test_blocks_split_into_head_shards_and_merged_back() -> None:
    """Different tensor-parallel splits of the KV heads: a whole pool's blocks cut into the
    head ranges [0, 1) and [1, 4) of two ranks land in those ranks' pools as the right heads;
    the ranks' exports merged side by side are the whole pool's bytes again."""
    from dynamo.pytorch.kv_cache import (
        KVBlocks,
        KVCache,
        KVLayout,
        convert_blocks,
        merge_head_shards,
    )
    from dynamo.router.hashing import sequence_hashes

    whole = KVLayout(num_layers=2, block_size=16, num_kv_heads=4, head_dim=8, dtype="float32")
    src = KVCache.allocate(whole, 8, torch.device("cpu"))
    for k, v in src.pools:
        k.normal_()
        v.normal_()
    tokens = list(range(7, 7 + 48))
    hashes = sequence_hashes(local_block_hashes(tokens, 16))
    local = local_block_hashes(tokens, 16)
    received = KVBlocks(
        layout=whole, block_hashes=hashes, local_hashes=local, data=src.export_slots([2, 3, 4])
    )
    ranks = [
        KVLayout(
            num_layers=2,
            block_size=16,
            num_kv_heads=stop - start,
            head_dim=8,
            dtype="float32",
            head_start=start,
            total_kv_heads=4,
        )
        for start, stop in ((0, 1), (1, 4))
    ]
    shards = []
    for rank in ranks:
        part = convert_blocks(received, rank, tokens)
        assert part.block_hashes == hashes
        pool = KVCache.allocate(rank, 4, torch.device("cpu"))
        pool.import_slots([0, 1, 2], part.data)
        for (sk, sv), (dk, dv) in zip(src.pools, pool.pools, strict=True):
            for s, d in ((sk, dk), (sv, dv)):  # [heads, blocks, block_size, dim]
                assert torch.equal(d[:, 0:3], s[rank.head_start : rank.head_stop, 2:5])
        shards.append(
            KVBlocks(layout=rank, block_hashes=hashes, local_hashes=local, data=part.data)
        )
    merged = merge_head_shards(list(reversed(shards)))  # any order: merged in head order
    assert merged.layout == whole and merged.data == received.data
    with pytest.raises(ValueError, match="gap or overlap"):
        merge_head_shards([shards[0], shards[0]])
    with pytest.raises(ValueError, match="do not cover"):
        convert_blocks(shards[0], ranks[1], tokens)

"""The PyTorch engine against transformers' ``generate`` (request by request) on a tiny random
Llama (hidden 256, 4 layers), CPU, one torch thread, ISL 128 / OSL 64 (ignore_eos, greedy).

For each concurrency (1, 8, 32) the engine serves ``2 * c`` requests (at least 8) with ``c`` in
flight, in process (``TorchEngine.generate``; no HTTP, as ``generate`` has none), and reports
output tokens/s over the run, TTFT p50 and ITL p50 (per-token gaps; a coalesced chunk of k
tokens counts as k gaps of its interval / k). transformers runs one request at a time (its
``generate`` has no continuous batching), so its tokens/s does not depend on concurrency; it is
measured right before each level (the machine is shared and noisy) and each level's speedup is
against that. Its TTFT is a ``max_new_tokens=1`` call and its ITL the rest of a 64-token call
per token.

    .venv/bin/python -m benchmarks.pytorch_engine [--requests-scale 2] [--hf-requests 4]

Results: printed, and ``bench-results/pytorch_engine.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dynamo.protocol.request import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo.pytorch.config import TorchEngineConfig
from dynamo.pytorch.engine import TorchEngine
from dynamo.runtime.context import Context

ISL, OSL = 128, 64
VOCAB = 4096


def build_model(root: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root)
    return root


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, VOCAB, (ISL,), generator=g).tolist() for _ in range(n)]


async def bench_engine(model: Path, concurrency: int, num_requests: int) -> dict[str, float]:
    engine = TorchEngine(
        TorchEngineConfig(
            model_path=str(model),
            block_size=16,
            num_gpu_blocks_override=(ISL + OSL) // 16 * 40,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,  # random prompts; measure compute, not cache hits
        )
    )
    await engine.start(1)
    ttfts: list[float] = []
    itls: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(tokens: list[int]) -> int:
        async with sem:
            req = PreprocessedRequest(
                model="bench",
                token_ids=tokens,
                sampling=SamplingOptions(temperature=0.0),
                stop=StopConditions(max_tokens=OSL, ignore_eos=True),
            )
            start = last = time.perf_counter()
            n = 0
            async for out in engine.generate(req, Context()):
                now = time.perf_counter()
                k = len(out.token_ids)
                if k and n == 0:
                    ttfts.append(now - start)
                    itls.extend([(now - last) / k] * (k - 1))
                elif k:
                    itls.extend([(now - last) / k] * k)
                n += k
                last = now
            return n

    # Warm-up (first-call allocations), not measured.
    await one(prompts(1, 99)[0])
    ttfts.clear()
    itls.clear()
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts(num_requests, concurrency)))
    elapsed = time.perf_counter() - t0
    stats = engine.stats
    await engine.cleanup()
    assert all(c == OSL for c in counts)
    return {
        "output_tokens_per_s": sum(counts) / elapsed,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "itl_p50_ms": statistics.median(itls) * 1000,
        "mean_batch": stats.num_batched_requests / stats.num_steps if stats else 0.0,
    }


def bench_transformers(model_dir: Path, num_requests: int) -> dict[str, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None

    def generate(tokens: list[int], n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([tokens]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == len(tokens) + n
        return time.perf_counter() - start

    generate(prompts(1, 99)[0], 4)  # warm-up
    ttfts, itls, totals = [], [], []
    for tokens in prompts(num_requests, 7):
        ttft = generate(tokens, 1)
        total = generate(tokens, OSL)
        ttfts.append(ttft)
        totals.append(total)
        itls.append((total - ttft) / (OSL - 1))
    return {
        "output_tokens_per_s": OSL * len(totals) / sum(totals),
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "itl_p50_ms": statistics.median(itls) * 1000,
    }


def _fmt(r: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.1f}" for k, v in r.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-scale", type=int, default=2, help="requests = scale * c")
    parser.add_argument("--hf-requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, object] = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "isl": ISL,
        "osl": OSL,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "tiny-llama-256x4")
        # The machine is shared and noisy: transformers is measured right before each level,
        # and each level's speedup is against that measurement.
        for c in args.concurrency:
            hf = bench_transformers(model, args.hf_requests)
            r = asyncio.run(bench_engine(model, c, max(8, args.requests_scale * c)))
            r["speedup_vs_transformers"] = r["output_tokens_per_s"] / hf["output_tokens_per_s"]
            results[f"c{c}"] = {"engine": r, "transformers": hf}
            print(f"c={c}: transformers {_fmt(hf)}")
            print(f"c={c}: engine       {_fmt(r)}")
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    (out / "pytorch_engine.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

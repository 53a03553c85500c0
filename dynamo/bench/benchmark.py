"""``run_benchmark``: one whole run. Checks the server (an OpenAI model list, then one small
streaming request), builds the workload with the model's tokenizer, runs the warm-up and the
measured load, measures server and client CPU, and writes the report folder if asked.

Errors the user must fix (unreachable URL, not an OpenAI server, bad trace, bad settings)
raise :class:`BenchError` with a one-line message; the CLI prints it and exits with 2.
"""

from __future__ import annotations

import random
import resource
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import msgspec

from dynamo.bench.client import Endpoint, HttpClient
from dynamo.bench.config import BenchConfig
from dynamo.bench.cpu import CpuMeter
from dynamo.bench.prompts import PromptBuilder
from dynamo.bench.report import summarize, write_report
from dynamo.bench.request import RequestRecord, RequestSpec, Sender
from dynamo.bench.runner import Budget, LoadRunner, Progress
from dynamo.bench.trace import TraceError, TraceWorkload, load_trace
from dynamo.bench.workload import (
    MultiTurnWorkload,
    PrefixWorkload,
    Session,
    SyntheticWorkload,
    Workload,
)
from dynamo.preprocess import ModelDir, demo_model_path, load_model_dir

PREFLIGHT_TIMEOUT_S = 15.0
_HUGE_CONTEXT = 1 << 30  # the bench never clamps; the server decides


class BenchError(Exception):
    """A problem the user must fix; the message is one line without a traceback."""


@dataclass(slots=True)
class BenchResult:
    summary: dict[str, Any]
    records: list[RequestRecord]
    origin: float  # perf_counter at the start of the measured phase


class _ModelList(msgspec.Struct):
    data: list[dict[str, Any]]


async def check_server(client: HttpClient, wanted: str | None) -> str:
    """GET /v1/models; returns the model to use. BenchError when the server is unreachable,
    does not answer like an OpenAI server, or does not serve ``wanted``."""
    url = client.endpoint.base_url
    try:
        response = await client.request("GET", "/v1/models", timeout=PREFLIGHT_TIMEOUT_S)
    except TimeoutError:
        raise BenchError(f"{url} did not answer within {PREFLIGHT_TIMEOUT_S:.0f} s") from None
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise BenchError(f"cannot connect to {url}: {reason}") from None
    where = f"{url} is not an OpenAI-compatible server: GET /v1/models"
    if response.status != 200:
        raise BenchError(f"{where} returned HTTP {response.status}")
    try:
        models = msgspec.json.decode(response.body, type=_ModelList)
    except msgspec.DecodeError:
        kind = response.content_type or "no content type"
        raise BenchError(f"{where} did not return a model list (got {kind})") from None
    ids = [str(m["id"]) for m in models.data if isinstance(m.get("id"), str)]
    if not ids:
        raise BenchError(f"{url} serves no models yet (GET /v1/models is empty)")
    if wanted is None:
        return ids[0]
    if wanted not in ids:
        raise BenchError(f"{url} does not serve model {wanted!r} (it serves {', '.join(ids)})")
    return wanted


def load_tokenizer(config: BenchConfig, model: str) -> ModelDir:
    path = config.tokenizer
    if path is None:
        if model != "demo":
            raise BenchError(
                f"--tokenizer DIR is needed for model {model!r}: a directory with its "
                "tokenizer.json (and chat template), used to build exact-length prompts"
            )
        path = str(demo_model_path())
    try:
        return load_model_dir(path, context_length=_HUGE_CONTEXT)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot load the tokenizer from {path}: {exc}") from None


def build_workload(
    config: BenchConfig, builder: PromptBuilder, *, packed: bool = False
) -> Workload:
    """``config``'s workload. ``packed``: a prefix workload's token-id prompts as ``array('I')``
    (the offline replay's, never sent over HTTP)."""
    kind = config.workload
    if kind == "synthetic":
        return SyntheticWorkload(
            builder,
            isl=config.isl,
            osl=config.osl,
            isl_stddev=config.isl_stddev,
            osl_stddev=config.osl_stddev,
            seed=config.seed,
        )
    if kind == "prefix":
        return PrefixWorkload(
            builder,
            groups=config.prefix_groups,
            prefix_len=config.prefix_len,
            suffix_len=config.suffix_len,
            osl=config.osl,
            seed=config.seed,
            packed=packed,
        )
    if kind == "multi-turn":
        return MultiTurnWorkload(
            builder, turns=config.turns, isl=config.isl, osl=config.osl, seed=config.seed
        )
    assert config.trace is not None  # validate() checked it
    return TraceWorkload(
        builder,
        load_trace(config.trace),
        block_size=config.trace_block_size,
        speedup=config.trace_speedup,
        seed=config.seed,
    )


async def _probe(sender: Sender, builder: PromptBuilder, url: str) -> None:
    """One small streaming request: the endpoint must answer with an OpenAI SSE stream."""
    _, messages, prompt = builder.fit([], max(8, builder.overhead + 4), random.Random(7))
    spec = RequestSpec(max_tokens=2, expected_prompt_tokens=0, messages=messages, prompt=prompt)
    record = await sender.send(spec)
    if record.error is None:
        return
    if record.error in ("protocol", "incomplete") or record.error == "http_404":
        raise BenchError(
            f"{url} is not an OpenAI-compatible streaming endpoint: {record.error_message}"
        )
    raise BenchError(f"a test request to {url} failed ({record.error}): {record.error_message}")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run ``config`` and return the summary and records (also written to ``output_dir``)."""
    try:
        config.validate()
        endpoint = Endpoint.parse(config.url)
        meter = CpuMeter(list(config.server_pids))
        meter.check()
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    client = HttpClient(endpoint, headers=headers, quickack=config.quickack)
    try:
        return await _run(config, client, meter)
    finally:
        await client.aclose()


async def _run(config: BenchConfig, client: HttpClient, meter: CpuMeter) -> BenchResult:
    url = client.endpoint.base_url
    model = await check_server(client, config.model)
    try:
        builder = PromptBuilder(
            load_tokenizer(config, model), api=config.api, prompt_format=config.prompt_format
        )
        workload = build_workload(config, builder)
        warmup = SyntheticWorkload(builder, isl=config.isl, osl=config.osl, seed=config.seed + 1)
    except (ValueError, TraceError) as exc:
        raise BenchError(str(exc)) from None

    def sender(collect_text: bool) -> Sender:
        return Sender(
            client,
            api=config.api,
            model=model,
            ignore_eos=config.ignore_eos,
            extra_body=config.extra_body,
            timeout=config.request_timeout_s,
            collect_text=collect_text,
        )

    await _probe(sender(False), builder, url)
    show = sys.stderr.isatty() if config.progress is None else config.progress
    if config.warmup:
        warm_concurrency = config.concurrency if not config.open_loop else 8
        runner = LoadRunner(
            send=sender(False).send,
            budget=Budget(config.warmup),
            concurrency=min(config.warmup, config.max_concurrency or warm_concurrency),
            progress=Progress(label="warm-up", total=config.warmup, duration_s=None, enabled=show),
        )
        await runner.run(warmup.sessions(), open_loop=False)

    limit = config.request_limit
    sessions: Iterable[Session] = workload.sessions()
    total = limit
    if isinstance(workload, TraceWorkload):
        total = len(workload.entries) if limit is None else min(limit, len(workload.entries))
    if limit is not None and not workload.collect_text:
        # Build the prompts before the clock starts (tokenizing costs client CPU).
        sessions = list(islice(sessions, limit))
    runner = LoadRunner(
        send=sender(workload.collect_text).send,
        budget=Budget(limit),
        concurrency=config.concurrency,
        rate=config.rate,
        max_concurrency=config.max_concurrency,
        think_time_s=config.think_time_s,
        seed=config.seed,
        progress=Progress(
            label=workload.name, total=total, duration_s=config.duration_s, enabled=show
        ),
    )
    meter.start()
    client_cpu = _cpu_seconds()
    origin = time.perf_counter()
    if config.duration_s is not None:
        runner.budget.deadline = origin + config.duration_s
    records = await runner.run(sessions, open_loop=config.open_loop)
    end = max((r.end for r in records), default=time.perf_counter())
    client_cpu = _cpu_seconds() - client_cpu
    server_cpu = meter.stop() if config.server_pids else None
    summary = summarize(
        records,
        window_s=end - origin,
        config=config.to_dict(),
        server={"url": url, "model": model},
        server_cpu_s=server_cpu,
        client_cpu_s=client_cpu,
    )
    if config.output_dir:
        try:
            write_report(config.output_dir, summary, records, origin, plots=False)
        except OSError as exc:
            raise BenchError(f"cannot write the report to {config.output_dir}: {exc}") from None
        if config.plots:
            _plots(Path(config.output_dir) / "plots", records, origin)
    return BenchResult(summary=summary, records=records, origin=origin)


def _plots(directory: Path, records: list[RequestRecord], origin: float) -> None:
    """Plots are a convenience: without matplotlib the run still succeeds, with a warning."""
    try:
        from dynamo.bench.plots import write_plots

        write_plots(directory, sorted(records, key=lambda r: r.start), origin)
    except (OSError, ValueError) as exc:
        print(f"dynamo bench: warning: no plots: {exc}", file=sys.stderr)

"""Tracing cost per request, in one process (issue 17): the CPU the spans of one streamed
request cost in each tracing mode, without the rest of the stack, so the figure does not drown
in the noise of a shared machine the way ``benchmarks/stack.py --tracing`` figures do.

A request's spans as the stack makes them: the frontend's ``http-request``, ``preprocess`` and
``route`` (with their attributes), the worker's ``handle_payload`` and ``engine.generate`` (the
spec 000 attributes, and the per-chunk inter-token timing of a 64-token stream while recording).
Modes: ``local`` (the default: ids only), ``export`` (recorded, then OTLP-encoded and sent over
http/protobuf to a receiver in a child process, so its CPU is not counted here) and, for
comparison, ``sdk`` (the OpenTelemetry SDK's own spans, ``BatchSpanProcessor`` and OTLP/HTTP
exporter, when installed). CPU is ``time.process_time`` (all threads: the export thread too)
over ``--requests`` requests, after the export queue is flushed.

    .venv/bin/python benchmarks/tracing_cost.py            # local, export (and sdk if present)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also under `python -m benchmarks...`

from launcher import REPO, OtlpReceiverProcess  # noqa: E402

OSL = 64


def run_mode(mode: str, requests: int, endpoint: str) -> dict[str, float]:
    """One child process per mode (tracing is set up once per process)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OTEL_SDK_DISABLED", None)
    env.update(
        {
            "OTEL_EXPORT_ENABLED": "1" if mode == "export" else "0",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
        }
    )
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--requests", str(requests)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def child(mode: str, requests: int) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    if mode == "sdk":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
        processor = BatchSpanProcessor(OTLPSpanExporter())
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("bench")
        recording, flush = True, provider.shutdown
    else:
        from dynamo.observability import tracing

        tracing.setup_tracing("bench")
        tracer = tracing.tracer()
        recording, flush = tracing.recording(), tracing.shutdown_tracing

    def one() -> None:
        root = tracer.start_span(
            "http-request",
            kind=SpanKind.SERVER,
            attributes={
                "http.method": "POST",
                "endpoint": "chat_completions",
                "request_id": "5b8efff798038103d269b633813fc60c",
                "x_request_id": "",
            },
        )
        ctx = trace.set_span_in_context(root)
        with tracer.start_as_current_span("preprocess", context=ctx) as span:
            span.set_attribute("input_tokens", 128)
        attrs = {"router_mode": "kv", "candidates": 1}
        with tracer.start_as_current_span("route", context=ctx, attributes=attrs) as span:
            span.set_attribute("worker_id", "1f2e3d4c5b6a")
            span.set_attribute("overlap_blocks", 3)
            span.set_attribute("cost", 1.5)
        worker = tracer.start_span(
            "handle_payload",
            context=ctx,
            kind=SpanKind.SERVER,
            attributes={"request_id": "5b8efff798038103d269b633813fc60c", "model": "demo"},
        )
        gen = tracer.start_span(
            "engine.generate",
            context=trace.set_span_in_context(worker),
            attributes={"model": "demo", "input_tokens": 128, "disagg_role": "agg"},
        )
        started = last = time.monotonic()
        itls: list[float] = []
        for i in range(OSL):  # the adapter's per-chunk work, while recording
            if recording or i == 0:
                now = time.monotonic()
                if i:
                    itls.append((now - last) * 1000.0)
                else:
                    gen.set_attribute("ttft_ms", (now - started) * 1000.0)
                last = now
        gen.set_attribute("output_tokens", OSL)
        gen.set_attribute("cancelled", False)
        gen.set_attribute("finish_reason", "length")
        if itls:
            itls.sort()
            gen.set_attribute("avg_itl_ms", sum(itls) / len(itls))
            gen.set_attribute("itl_p50_ms", itls[len(itls) // 2])
            gen.set_attribute("itl_p99_ms", itls[-1])
            gen.set_attribute("itl_max_ms", itls[-1])
        gen.end()
        worker.end()
        root.set_attribute("model", "demo")
        root.set_attribute("request_type", "stream")
        root.set_attribute("status", "success")
        root.end()

    for _ in range(200):
        one()
    began = time.process_time()
    for _ in range(requests):
        one()
    flush()
    used = time.process_time() - began
    print(json.dumps({"us_per_request": used / requests * 1e6}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--modes", default="local,export,sdk")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.requests)
        return 0
    with OtlpReceiverProcess() as receiver:
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            try:
                result = run_mode(mode, args.requests, receiver.endpoint)
            except subprocess.CalledProcessError as exc:
                print(f"{mode:>7}: failed ({exc.stderr.strip().splitlines()[-1:]})")
                continue
            print(f"{mode:>7}: {result['us_per_request']:.1f} us of CPU per request (5 spans)")
        print(f"spans received by the OTLP receiver: {receiver.spans()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``dynamo bench``: a load generator and benchmark reports for OpenAI-compatible endpoints.

Library use (what ``benchmarks/`` scripts do)::

    from dynamo.bench import BenchConfig, run_benchmark
    result = await run_benchmark(BenchConfig(url="http://127.0.0.1:8000", concurrency=16))
    result.summary["ttft_ms"]["p50"]
"""

from dynamo.bench.benchmark import BenchError, BenchResult, run_benchmark
from dynamo.bench.config import BenchConfig
from dynamo.bench.report import compare, format_summary, load_summary

__all__ = [
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "compare",
    "format_summary",
    "load_summary",
    "run_benchmark",
]

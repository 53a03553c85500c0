"""``BenchConfig``: everything one benchmark run needs, shared by the CLI and library callers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

WORKLOADS = ("synthetic", "prefix", "multi-turn", "trace")
APIS = ("chat", "completions")


@dataclass(slots=True, kw_only=True)
class BenchConfig:
    """One run. Load: ``concurrency`` (closed loop) unless ``rate`` is set (open loop, Poisson
    arrivals per second; sessions per second for multi-turn); a trace sets its own arrivals.
    Length: ``num_requests`` and/or ``duration_s`` (whichever ends first; requests that
    started in time are waited for); with neither, 100 requests (a whole trace for replay).
    ``warmup`` requests (synthetic, unmeasured) run first at the same concurrency.
    ``model=None`` takes the server's first model from ``/v1/models``; ``tokenizer=None`` uses
    the bundled demo model when the model is ``demo``.
    """

    url: str
    model: str | None = None
    api: str = "chat"
    tokenizer: str | None = None
    prompt_format: str = "ids"
    workload: str = "synthetic"
    isl: int = 128
    osl: int = 64
    isl_stddev: float = 0.0
    osl_stddev: float = 0.0
    prefix_groups: int = 4
    prefix_len: int = 256
    suffix_len: int = 64
    turns: int = 3
    think_time_s: float = 0.0
    trace: str | None = None
    trace_block_size: int = 512
    trace_speedup: float = 1.0
    concurrency: int = 1
    rate: float | None = None
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 600.0
    server_pids: list[int] = field(default_factory=list)
    output_dir: str | None = None
    plots: bool = True
    progress: bool | None = None
    quickack: bool = False  # TCP_QUICKACK on the client's sockets (Linux)

    def validate(self) -> None:
        """Raises ValueError with a one-line message for inconsistent settings."""
        if self.api not in APIS:
            raise ValueError(f"--api must be one of {', '.join(APIS)}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError("--prompt-format must be ids or text")
        if self.workload == "trace" and not self.trace:
            raise ValueError("--workload trace needs --trace FILE")
        if self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("--rate must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be at least 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("--duration must be > 0")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        if self.request_timeout_s <= 0:
            raise ValueError("--request-timeout must be > 0")
        if self.think_time_s < 0:
            raise ValueError("--think-time must be >= 0")

    @property
    def request_limit(self) -> int | None:
        """How many measured requests to send at most (None: until the duration or trace ends)."""
        if self.num_requests is not None:
            return self.num_requests
        if self.duration_s is not None or self.workload == "trace":
            return None
        return 100

    @property
    def open_loop(self) -> bool:
        return self.rate is not None or self.workload == "trace"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("api_key", None)  # never write secrets into reports
        return data

"""What a replay simulates: the deployment (workers, their engine, the router) as data.

Workers are mocker engines (``MockerConfig``: blocks, block size, batch limits, speedup, DP
ranks). Aggregated: ``workers`` engines behind one router. Disaggregated (``prefill_workers`` >
0, xPyD): ``prefill_workers`` prefill engines and ``workers`` decode engines, each pool behind
its own router with the live frontend's per-role flags, dispatched as the frontend does (route
mode, FACTS §9.1): the decode router picks a decode worker, ``disagg``'s conditional rule decides
on a remote prefill, the prefill router picks a prefill worker, the prompt runs there with
``max_tokens`` 1, and its KV moves to the decode worker, which produces every output token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dynamo.frontend.disagg import DisaggSettings
from dynamo.mocker.config import MockerConfig
from dynamo.router.config import KVRouterSettings

ROUTER_MODES = ("round-robin", "random", "kv")
"""The frontend's router modes (``dynamo.frontend.config.ROUTER_MODES``)."""


@dataclass(frozen=True, slots=True)
class Deployment:
    """One simulated deployment. ``engine`` configures every worker (its ``num_workers`` is
    ignored: ``workers`` counts engines); ``prefill_engine`` the prefill pool (default: the
    same engine as a prefill worker)."""

    workers: int = 1
    router_mode: str = "kv"
    kv: KVRouterSettings = field(default_factory=KVRouterSettings)
    engine: MockerConfig = field(default_factory=MockerConfig)
    prefill_workers: int = 0
    prefill_engine: MockerConfig | None = None
    disagg: DisaggSettings = field(default_factory=DisaggSettings)
    router_seed: int | None = None
    """Seeds the routers' random choices (tie-breaks between equal-cost workers, the random
    router); None: the workload's ``--seed``. Replaying one workload under several router seeds
    shows how much of a figure is tie-break luck."""
    frontend_ms: float = 0.0
    """The frontend's own time a request (parsing, hashing, routing), in simulated ms: the
    router sees the requests one after another at this pace, in send order, so a burst of
    sends reaches it spread out, as it reaches a live frontend's one event loop (a live stack
    then routes the burst's later requests with the earlier ones' KV events already in the
    index). 0: the router sees each request the instant it is sent."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("--workers must be at least 1")
        if not 0 <= self.frontend_ms < float("inf"):
            raise ValueError("--frontend-ms must be a finite number >= 0")
        if self.prefill_workers < 0:
            raise ValueError("--prefill-workers must be >= 0")
        if self.router_mode not in ROUTER_MODES:
            raise ValueError(f"--router-mode must be one of {', '.join(ROUTER_MODES)}")
        if self.disagg.dispatch != "route":  # refused, not silently simulated as route
            raise ValueError("the replay simulates --prefill-dispatch route only")
        if self.kv.queue_threshold is not None and (self.router_mode != "kv" or self.disaggregated):
            raise ValueError(
                "the replay simulates --router-queue-threshold with --router-mode kv and "
                "aggregated workers only"
            )

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0

    def decode_config(self) -> MockerConfig:
        """The engine of the ``workers`` pool (a decode worker when disaggregated)."""
        mode = "decode" if self.disaggregated else "agg"
        return dataclasses.replace(self.engine, disaggregation_mode=mode, num_workers=1)

    def prefill_config(self) -> MockerConfig:
        base = self.prefill_engine or self.engine
        return dataclasses.replace(base, disaggregation_mode="prefill", num_workers=1)

    @property
    def num_engines(self) -> int:
        """Engines in the deployment (what a capacity plan pays for, in workers)."""
        return self.workers + self.prefill_workers

    def describe(self) -> dict[str, object]:
        """A JSON-ready description (the report's ``deployment``)."""
        eng = self.engine
        out: dict[str, object] = {
            "workers": self.workers,
            "prefill_workers": self.prefill_workers,
            "router_mode": self.router_mode,
            "block_size": eng.block_size,
            "num_gpu_blocks": eng.num_gpu_blocks,
            "max_num_seqs": eng.max_num_seqs,
            "max_num_batched_tokens": eng.max_num_batched_tokens,
            "data_parallel_size": eng.data_parallel_size,
            "speedup_ratio": eng.speedup_ratio,
            "decode_speedup_ratio": eng.decode_speedup_ratio,
        }
        if self.router_seed is not None:
            out["router_seed"] = self.router_seed
        if self.frontend_ms:
            out["frontend_ms"] = self.frontend_ms
        if self.router_mode == "kv":
            out["kv_router"] = dataclasses.asdict(self.kv)
        return out

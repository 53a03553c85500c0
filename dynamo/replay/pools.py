"""The simulated workers: one pool per role (aggregated/decode, or prefill), its DP ranks (each a
``MockerScheduler``) and the live router code that places requests on them (``RoutingCore`` for
``kv``, ``router.basic`` for ``round-robin`` / ``random``)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from dynamo.frontend.app import role_settings
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.simulator import MockerScheduler, StepOutput
from dynamo.protocol.model_card import ModelCard, WorkerRole
from dynamo.protocol.request import PreprocessedRequest
from dynamo.replay.deployment import Deployment
from dynamo.router.basic import RandomRouter, RoundRobinRouter
from dynamo.router.core import RoutingCore, WorkerSpec
from dynamo.router.queue import PendingQueue, QueuePolicy

IDLE, SCHEDULED, BUSY = 0, 1, 2
"""A rank's state: no pass planned; a pass start is on the heap; a pass runs."""
WORKER_ID_BASE = 0x1000
"""Worker ids are ``WORKER_ID_BASE + index`` (prefill workers follow the decode pool)."""
MODEL = "replay"


class RoutingRecord(msgspec.Struct, gc=False):
    """Where one request went and why (``cost``: the KV router's cost, lower is better).

    Every request keeps one to the report: a Struct the collector does not track (numbers only,
    no reference cycle possible), one object fewer for each of its collections to traverse."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int = 0
    cost: float | None = None
    prefill_worker_id: int | None = None
    prefill_dp_rank: int | None = None
    prefill_overlap_blocks: int | None = None


@dataclass(slots=True, eq=False)
class Rank:
    """One DP rank of one worker: its scheduler and the pass it runs (``out``)."""

    worker_id: int
    dp_rank: int
    sched: MockerScheduler
    pool: Pool
    state: int = IDLE
    out: StepOutput | None = None
    raw: tuple[Any, ...] | None = None  # the native loop's running pass (mock_pass's tuple)
    passes: int = 0


@dataclass(slots=True, eq=False)
class Pool:
    """One role's workers, their ranks and their router."""

    config: MockerConfig
    cards: list[ModelCard]
    ranks: dict[tuple[int, int], Rank]
    core: RoutingCore | None
    basic: RoundRobinRouter | RandomRouter | None
    role: str
    queue: PendingQueue[Any] | None = None  # the router queue (kv, --router-queue-threshold)

    def core_saturated(self) -> bool:
        """Whether every worker of the pool is past the router queue's threshold."""
        return self.core is not None and self.core.saturated()

    def route(
        self, request_id: str, tokens: Sequence[int], local: list[int], seqs: list[int]
    ) -> tuple[Rank, RoutingRecord]:
        """Place a request as the live frontend would (``DynamoError`` if it cannot)."""
        core = self.core
        if core is not None:
            chosen = core.route(request_id, local, len(tokens), seq_hashes=seqs)
            worker_id, dp_rank = chosen.worker_id, chosen.dp_rank
            out = RoutingRecord(worker_id, dp_rank, chosen.overlap_blocks, chosen.cost)
            return self.ranks[(worker_id, dp_rank)], out
        assert self.basic is not None
        ids = tokens if isinstance(tokens, list) else list(tokens)  # a packed prompt
        request = PreprocessedRequest(model=MODEL, token_ids=ids)
        selection = self.basic.select(request, self.cards)
        worker = selection.instance_id
        if selection.dp_rank is not None:
            rank = self.ranks[(worker, selection.dp_rank)]
        else:  # the mocker picks the rank with the fewest requests (engine._pick_rank)
            ranks = [self.ranks[(worker, r)] for r in range(self.config.data_parallel_size)]
            rank = min(ranks, key=lambda r: len(r.sched._requests))  # noqa: SLF001
        return rank, RoutingRecord(worker, rank.dp_rank)


def build_pool(
    deployment: Deployment,
    config: MockerConfig,
    n: int,
    base: int,
    seed: int,
    role: str,
    clock: Callable[[], float],
) -> Pool:
    """``n`` workers of ``config`` (ids from ``base``) behind the deployment's router, whose
    random choices are seeded from ``seed`` and whose time is ``clock`` (the virtual one)."""
    cards: list[ModelCard] = []
    ranks: dict[tuple[int, int], Rank] = {}
    core: RoutingCore | None = None
    basic: RoundRobinRouter | RandomRouter | None = None
    if deployment.router_mode == "kv":
        kv = deployment.kv
        if deployment.disaggregated:  # each pool's router flags, as the live frontend sets them
            kv = role_settings(kv, WorkerRole(role))
        core = RoutingCore(config.block_size, kv, rng=random.Random(seed ^ 0x5EC7), clock=clock)
    elif deployment.router_mode == "random":
        basic = RandomRouter(random.Random(seed ^ 0x2A4D))
    else:
        basic = RoundRobinRouter()
    queue: PendingQueue[Any] | None = None
    if core is not None and core.settings.queue_threshold is not None:
        kv = core.settings
        queue = PendingQueue(QueuePolicy(kv.queue_policy), kv.queue_max_requests, clock=clock)
    pool = Pool(config, cards, ranks, core, basic, role, queue)
    for i in range(n):
        worker_id = base + i
        cards.append(
            ModelCard(
                served_model_name=MODEL,
                model_path="",
                context_length=config.max_model_len,
                namespace="replay",
                component=role,
                endpoint="generate",
                instance_id=worker_id,
                kv_block_size=config.block_size,
                total_kv_blocks=config.num_gpu_blocks,
                max_num_batched_tokens=config.max_num_batched_tokens,
                data_parallel_size=config.data_parallel_size,
            )
        )
        for r in range(config.data_parallel_size):
            sched = MockerScheduler(config, dp_rank=r)
            # the index is in this process: each pass's KV events as one raw buffer, no structs
            sched.kv.record_raw_events()
            ranks[(worker_id, r)] = Rank(worker_id, r, sched, pool)
        if core is not None:
            core.add_worker(
                WorkerSpec(
                    worker_id,
                    0,
                    config.data_parallel_size,
                    config.num_gpu_blocks,
                    config.max_num_batched_tokens,
                )
            )
    return pool

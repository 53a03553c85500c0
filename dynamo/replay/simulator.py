"""The discrete-event simulator: a whole deployment on a virtual clock (FACTS §12).

Each DP rank of each worker is a ``MockerScheduler`` (the shared ``engine_core`` scheduler and
KV manager, timed by the mocker's model); requests are placed by the live routers' code
(``RoutingCore`` for ``kv``, ``router.basic`` for ``round-robin`` / ``random``); the load is
``dynamo bench``'s sessions, closed loop (``concurrency``) or open loop (arrival times, or a
Poisson ``rate``). Nothing sleeps and nothing touches a socket: time is a heap of events.

Events, in time order (ties: arrivals first, then pass ends, then pass starts, each FIFO):

* ``SEND``: a session runner sends its next request (closed loop: when its previous request
  ended, plus think time; open loop: at the session's arrival). It is routed at once and queued
  on the chosen rank, whose next pass starts now if the rank is idle. Requests that arrive at the
  same instant therefore share a pass, as FACTS §6.4 measured (two simultaneous requests: one
  prefill of both prompts).
* ``PASS_START``: the rank's scheduler plans and applies one forward pass (``step``); its tokens
  exist at ``start + duration``, when ``PASS_END`` delivers them: first tokens (TTFT, the
  router's prefill-completed), later ones (ITL), finished requests (the router frees them, the
  runner continues) and the pass's KV events (applied to the KV router's index). A rank with
  work left starts its next pass right away, back to back, as the live step loop does.

Deterministic for a given seed: one ``random.Random`` per use, seeded from it, and no
dependence on wall-clock time or hash ordering.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dynamo.bench.request import RequestRecord, RequestSpec
from dynamo.bench.workload import Session
from dynamo.engine_core.sequence import Sequence, sequence_from_request
from dynamo.frontend.app import role_settings
from dynamo.frontend.disagg import prefill_remotely
from dynamo.frontend.errors import to_http
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.simulator import MockerScheduler, StepOutput
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.model_card import ModelCard, WorkerRole
from dynamo.protocol.request import PreprocessedRequest, RoutingHints, StopConditions
from dynamo.replay.deployment import Deployment
from dynamo.router.basic import RandomRouter, RoundRobinRouter
from dynamo.router.core import RoutingCore, WorkerSpec
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.runtime.errors import DynamoError

_SEND, _PASS_END, _PASS_START = 0, 1, 2
_IDLE, _SCHEDULED, _BUSY = 0, 1, 2
WORKER_ID_BASE = 0x1000
"""Worker ids are ``WORKER_ID_BASE + index`` (prefill workers follow the decode pool)."""
MODEL = "replay"


@dataclass(slots=True)
class LoadSpec:
    """How requests are offered: closed loop (``concurrency`` runners) unless ``rate`` is set
    or sessions carry arrival times (open loop). ``limit``: most requests (None: until the
    sessions or ``duration_s`` end). ``max_concurrency`` caps requests in flight (open loop)."""

    concurrency: int = 1
    rate: float | None = None
    open_loop: bool = False
    max_concurrency: int | None = None
    limit: int | None = 100
    duration_s: float | None = None
    think_time_s: float = 0.0
    seed: int = 0


@dataclass(slots=True)
class RoutingRecord:
    """Where one request went and why (``cost``: the KV router's cost, lower is better;
    ``costs``: every candidate's, keyed ``worker_id:dp_rank``)."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int = 0
    cost: float | None = None
    prefill_worker_id: int | None = None
    prefill_dp_rank: int | None = None
    prefill_overlap_blocks: int | None = None


@dataclass(slots=True)
class Flight:
    """One request through the simulation: its bench record and its routing."""

    index: int
    request_id: str
    record: RequestRecord
    spec: RequestSpec
    runner: _Runner
    tokens: list[int]
    routing: RoutingRecord | None = None
    last_token_at: float = 0.0
    decode_rank: _Rank | None = None  # disaggregated: where the decode runs after the prefill


@dataclass(slots=True, eq=False)
class _Rank:
    worker_id: int
    dp_rank: int
    sched: MockerScheduler
    pool: _Pool
    state: int = _IDLE
    out: StepOutput | None = None
    passes: int = 0


@dataclass(slots=True, eq=False)
class _Runner:
    """A closed-loop concurrency slot or an open-loop session: sends one request at a time."""

    session: Session | None
    previous: RequestRecord | None = None
    taken: bool = False  # the budget was taken for the next request already (open loop)
    pending: RequestSpec | None = None  # drawn, waiting out the think time
    pulls: bool = True  # takes a new session when its session ends (closed loop)


@dataclass(slots=True, eq=False)
class _Pool:
    """One role's workers (aggregated/decode, or prefill), their ranks and their router."""

    config: MockerConfig
    cards: list[ModelCard]
    ranks: dict[tuple[int, int], _Rank]
    core: RoutingCore | None
    basic: RoundRobinRouter | RandomRouter | None
    role: str


@dataclass(slots=True)
class SimulationResult:
    flights: list[Flight]
    simulated_s: float
    wall_s: float
    passes: int
    events: int = 0
    per_rank_passes: dict[str, int] = field(default_factory=dict)


class Simulation:
    """One replay run. Build it, then :meth:`run` once."""

    def __init__(
        self,
        deployment: Deployment,
        sessions: Iterator[Session],
        load: LoadSpec,
        *,
        decode_text: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.deployment = deployment
        self.load = load
        self._sessions = sessions
        self._decode_text = decode_text
        self._heap: list[tuple[float, int, int, object]] = []
        self._counter = itertools.count()
        self.now = 0.0
        self.flights: list[Flight] = []
        self._by_id: dict[str, Flight] = {}
        self._issued = 0
        self._stopped = False  # the budget ran out: no new sessions
        self._in_flight = 0
        self._remote_prefills = 0  # disaggregated: prefills in flight on prefill workers
        self._queued: deque[tuple[RequestSpec, _Runner]] = deque()
        seed = load.seed
        self._decode = self._pool(
            deployment.decode_config(), deployment.workers, WORKER_ID_BASE, seed, "decode"
        )
        self._prefill = (
            self._pool(
                deployment.prefill_config(),
                deployment.prefill_workers,
                WORKER_ID_BASE + deployment.workers,
                seed + 1,
                "prefill",
            )
            if deployment.disaggregated
            else None
        )
        self._hash_size = self._decode.config.block_size

    # -- construction -----------------------------------------------------------------------
    def _pool(self, config: MockerConfig, n: int, base: int, seed: int, role: str) -> _Pool:
        cards: list[ModelCard] = []
        ranks: dict[tuple[int, int], _Rank] = {}
        dep = self.deployment
        core: RoutingCore | None = None
        basic: RoundRobinRouter | RandomRouter | None = None
        if dep.router_mode == "kv":
            kv = dep.kv
            if dep.disaggregated:  # each pool's router flags, as the live frontend sets them
                kv = role_settings(kv, WorkerRole(role))
            core = RoutingCore(
                config.block_size, kv, rng=random.Random(seed ^ 0x5EC7), clock=self._clock
            )
        elif dep.router_mode == "random":
            basic = RandomRouter(random.Random(seed ^ 0x2A4D))
        else:
            basic = RoundRobinRouter()
        pool = _Pool(config, cards, ranks, core, basic, role)
        for i in range(n):
            worker_id = base + i
            card = ModelCard(
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
            cards.append(card)
            for r in range(config.data_parallel_size):
                ranks[(worker_id, r)] = _Rank(
                    worker_id, r, MockerScheduler(config, dp_rank=r), pool
                )
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

    def _clock(self) -> float:
        return self.now

    # -- the event loop ---------------------------------------------------------------------
    def _push(self, when: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (when, kind, next(self._counter), payload))

    def run(self) -> SimulationResult:
        started = time.perf_counter()
        load = self.load
        if load.open_loop:
            self._push(0.0, _SEND, None)  # the first open-loop tick
            self._poisson = random.Random(load.seed ^ 0xA77)
            self._poisson_at = 0.0
        else:
            for _ in range(load.concurrency):
                self._push(0.0, _SEND, _Runner(None))
        heap, pop = self._heap, heapq.heappop
        events = 0
        while heap:
            when, kind, _, payload = pop(heap)
            self.now = when
            events += 1
            if kind == _PASS_END:
                assert isinstance(payload, _Rank)
                self._pass_end(payload)
            elif kind == _PASS_START:
                assert isinstance(payload, _Rank)
                self._pass_start(payload)
            elif payload is None:
                self._open_tick()
            else:
                assert isinstance(payload, _Runner)
                self._advance(payload)
        for flight in self._by_id.values():  # nothing left to run them: never completes
            flight.record.end = self.now
            flight.record.error = "incomplete"
            flight.record.error_message = "the simulation ended with the request unfinished"
        ranks = [*self._decode.ranks.values()]
        if self._prefill is not None:
            ranks += self._prefill.ranks.values()
        return SimulationResult(
            flights=self.flights,
            simulated_s=self.now,
            wall_s=time.perf_counter() - started,
            passes=sum(r.passes for r in ranks),
            events=events,
            per_rank_passes={f"{r.worker_id:x}:{r.dp_rank}": r.passes for r in ranks},
        )

    # -- load -------------------------------------------------------------------------------
    def _take(self) -> bool:
        """One more request may start (count limit and simulated deadline)."""
        load = self.load
        if self._stopped or (load.limit is not None and self._issued >= load.limit):
            self._stopped = True
            return False
        if load.duration_s is not None and self.now >= load.duration_s:
            self._stopped = True
            return False
        self._issued += 1
        return True

    def _open_tick(self) -> None:
        """Open loop: schedule the next session's start at its arrival (lazily, one ahead)."""
        if self._stopped:
            return
        session = next(self._sessions, None)
        if session is None:
            return
        arrival = session.arrival
        if arrival is None:
            if self.load.rate is None:
                raise ValueError("an open loop without a trace needs a rate")
            arrival = self._poisson_at
            self._poisson_at += self._poisson.expovariate(self.load.rate)
        if self.load.duration_s is not None and arrival >= self.load.duration_s:
            return
        when = max(arrival, self.now)
        self._push(when, _SEND, _Runner(session, pulls=False))
        self._push(when, _SEND, None)

    def _advance(self, runner: _Runner) -> None:
        """The runner's next request (or session): send it now, after think time, or stop."""
        load = self.load
        if not runner.pulls and runner.session is not None and runner.previous is None:
            if not runner.taken:  # an open-loop session starting: it takes the budget now
                if not self._take():
                    return
                runner.taken = True
        spec = runner.pending
        runner.pending = None
        while spec is None:
            if runner.session is None:
                if not runner.pulls or self._stopped:
                    return
                runner.session = next(self._sessions, None)
                runner.previous = None
                if runner.session is None:
                    return
            spec = runner.session.next(runner.previous)
            if spec is None:
                runner.session = None
                continue
            if runner.previous is not None and load.think_time_s > 0:
                runner.pending = spec
                self._push(self.now + load.think_time_s, _SEND, runner)
                return
        if not runner.taken and not self._take():
            return
        runner.taken = False
        cap = load.max_concurrency
        if cap is not None and self._in_flight >= cap:
            self._queued.append((spec, runner))
            return
        self._send(spec, runner)

    def _send(self, spec: RequestSpec, runner: _Runner) -> None:
        now = self.now
        index = len(self.flights)
        prompt = spec.prompt
        if not isinstance(prompt, list):
            raise ValueError("the replay needs token-id prompts (completions, ids)")
        record = RequestRecord(
            start=now,
            max_tokens=spec.max_tokens,
            expected_prompt_tokens=spec.expected_prompt_tokens,
            session=spec.session,
            turn=spec.turn,
            group=spec.group,
        )
        flight = Flight(index, f"replay-{index}", record, spec, runner, prompt)
        self.flights.append(flight)
        self._by_id[flight.request_id] = flight
        self._in_flight += 1
        local = local_block_hashes(prompt, self._hash_size)
        hashes = (local, sequence_hashes(local))
        try:
            rank, chosen = self._route(self._decode, flight, *hashes)
            flight.routing = chosen
            if self._remote(flight, chosen):
                assert self._prefill is not None
                flight.decode_rank = rank
                rank, pre = self._route(self._prefill, flight, *hashes)
                chosen.prefill_worker_id, chosen.prefill_dp_rank = pre.worker_id, pre.dp_rank
                chosen.prefill_overlap_blocks = pre.overlap_blocks
                self._remote_prefills += 1
            seq = self._sequence(rank, flight, hashes)
        except DynamoError as exc:
            self._fail(flight, exc)
            return
        self._enqueue(rank, seq)

    def _remote(self, flight: Flight, decode: RoutingRecord) -> bool:
        """Disaggregated: whether the prompt is prefilled on a prefill worker (the frontend's
        conditional-disaggregation rule, on the decode worker's reported prefix)."""
        prefill = self._prefill
        if prefill is None:
            return False
        cached = decode.overlap_blocks * self._hash_size
        queue = max(0, self._remote_prefills - len(prefill.cards))
        return prefill_remotely(self.deployment.disagg, len(flight.tokens), cached, queue)

    def _route(
        self, pool: _Pool, flight: Flight, local: list[int], seqs: list[int]
    ) -> tuple[_Rank, RoutingRecord]:
        core = pool.core
        if core is not None:
            chosen = core.route(flight.request_id, local, len(flight.tokens), seq_hashes=seqs)
            out = RoutingRecord(
                chosen.worker_id, chosen.dp_rank, chosen.overlap_blocks, chosen.cost
            )
            return pool.ranks[(chosen.worker_id, chosen.dp_rank)], out
        assert pool.basic is not None
        request = PreprocessedRequest(model=MODEL, token_ids=flight.tokens)
        selection = pool.basic.select(request, pool.cards)
        worker = selection.instance_id
        if selection.dp_rank is not None:
            rank = pool.ranks[(worker, selection.dp_rank)]
        else:  # the mocker picks the rank with the fewest requests (engine._pick_rank)
            ranks = [pool.ranks[(worker, r)] for r in range(pool.config.data_parallel_size)]
            rank = min(ranks, key=lambda r: len(r.sched._requests))  # noqa: SLF001
        return rank, RoutingRecord(worker, rank.dp_rank)

    def _sequence(
        self,
        rank: _Rank,
        flight: Flight,
        hashes: tuple[list[int], list[int]],
        *,
        handoff: DisaggregatedParams | None = None,
    ) -> Sequence:
        request = PreprocessedRequest(
            model=MODEL,
            token_ids=flight.tokens,
            request_id=flight.request_id,
            stop=StopConditions(max_tokens=flight.spec.max_tokens, ignore_eos=True),
            routing=RoutingHints(dp_rank=rank.dp_rank),
            prefill_result=handoff,
        )
        return sequence_from_request(
            rank.pool.config, request, flight.request_id, self.now, hashes=hashes
        )

    def _enqueue(self, rank: _Rank, seq: Sequence) -> None:
        rank.sched.enqueue(seq)
        if rank.state == _IDLE:
            rank.state = _SCHEDULED
            self._push(self.now, _PASS_START, rank)

    def _fail(self, flight: Flight, exc: DynamoError) -> None:
        record = flight.record
        record.end = self.now
        reply = to_http(exc)
        record.status = reply.status
        record.error = f"http_{reply.status}"
        record.error_message = str(exc)
        self._finish(flight)

    # -- passes -----------------------------------------------------------------------------
    def _pass_start(self, rank: _Rank) -> None:
        sched = rank.sched
        out = sched.step(self.now)
        if out.is_empty:
            rank.state = _IDLE
            ready = sched.next_ready_at()
            if ready is not None:  # every runnable request waits for its KV transfer
                rank.state = _SCHEDULED
                self._push(max(ready, self.now), _PASS_START, rank)
            return
        rank.passes += 1
        rank.out = out
        rank.state = _BUSY
        self._push(self.now + out.duration, _PASS_END, rank)

    def _pass_end(self, rank: _Rank) -> None:
        out = rank.out
        assert out is not None
        rank.out = None
        now = self.now
        pool = rank.pool
        core = pool.core
        if core is not None and out.events:
            worker_id = rank.worker_id
            for event in out.events:
                core.apply_event(worker_id, event)
        by_id = self._by_id
        prefill_pool = pool.role == "prefill"
        if not prefill_pool:
            for seq, _token in out.tokens:
                flight = by_id[seq.request_id]
                record = flight.record
                if record.ttft is None:
                    record.ttft = now - record.start
                    if core is not None:
                        core.prefill_completed(flight.request_id)
                else:
                    record.itl.append(now - flight.last_token_at)
                flight.last_token_at = now
                record.output_tokens += 1
        for seq in out.finished:
            flight = by_id[seq.request_id]
            if core is not None:
                core.free(flight.request_id)
            if prefill_pool:
                self._to_decode(flight, seq, rank)
                continue
            record = flight.record
            record.end = now
            record.status = 200
            record.prompt_tokens = seq.num_prompt_tokens
            if record.cached_tokens is None:
                record.cached_tokens = seq.num_cached_tokens or 0
            record.finish_reason = "length" if seq.finish_reason is None else _finish(seq)
            if self._decode_text is not None:
                record.text = self._decode_text(seq.tokens[seq.num_prompt_tokens :])
            self._finish(flight)
        if rank.sched.has_work:
            rank.state = _SCHEDULED
            self._push(now, _PASS_START, rank)
        else:
            rank.state = _IDLE

    def _to_decode(self, flight: Flight, seq: Sequence, prefill_rank: _Rank) -> None:
        """Disaggregation: the prompt's KV is ready on the prefill worker; it moves to the
        decode worker chosen at dispatch (transfer time), which decodes."""
        self._remote_prefills -= 1
        rank = flight.decode_rank
        assert rank is not None
        n_full = seq.num_prompt_tokens // seq.block_size
        handoff = DisaggregatedParams(
            prefill_worker_id=prefill_rank.worker_id,
            prefill_dp_rank=prefill_rank.dp_rank,
            block_hashes=seq.block_hashes[:n_full],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )
        hashes = (seq.local_hashes[:n_full], seq.block_hashes[:n_full])
        try:
            dseq = self._sequence(rank, flight, hashes, handoff=handoff)
        except DynamoError as exc:
            self._fail(flight, exc)
            return
        self._enqueue(rank, dseq)

    def _finish(self, flight: Flight) -> None:
        """The request ended: its runner goes on, a queued request (max_concurrency) starts."""
        self._in_flight -= 1
        del self._by_id[flight.request_id]
        runner = flight.runner
        runner.previous = flight.record
        self._push(self.now, _SEND, runner)
        if self._queued and (
            self.load.max_concurrency is None or self._in_flight < self.load.max_concurrency
        ):
            spec, queued = self._queued.popleft()
            self._send(spec, queued)


def _finish(seq: Sequence) -> str:
    reason = seq.finish_reason
    assert reason is not None
    return str(reason.value)

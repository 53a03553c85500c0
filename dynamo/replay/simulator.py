"""The discrete-event simulator: a whole deployment on a virtual clock (FACTS §12).

Each DP rank of each worker is a ``MockerScheduler`` (the shared ``engine_core`` scheduler and
KV manager, timed by the mocker's model); requests are placed by the live routers' code
(``RoutingCore`` for ``kv``, ``router.basic`` for ``round-robin`` / ``random``); the load is
``dynamo bench``'s sessions driven by ``replay.load`` (closed or open loop), optionally after a
warm-up phase whose requests warm the caches and the router but are not reported. Nothing
sleeps and nothing touches a socket: time is a heap of events.

Events, in time order (ties: arrivals first, then pass ends, then pass starts, each FIFO):

* ``SEND``: the load generator's runner sends its next request (closed loop: when its previous
  request ended, plus think time; open loop: at the session's arrival). It is routed at once and
  queued on the chosen rank, whose next pass starts now if the rank is idle. Requests that arrive
  at the same instant therefore share a pass, as FACTS §6.4 measured (two simultaneous requests:
  one prefill of both prompts).
* ``PASS_START``: the rank's scheduler plans and applies one forward pass (``step``); its tokens
  exist at ``start + duration``, when ``PASS_END`` delivers them: first tokens (TTFT, the
  router's prefill-completed), later ones (ITL), finished requests (the router frees them, the
  runner continues) and the pass's KV events (applied to the KV router's index). A rank with
  work left starts its next pass right away, back to back, as the live step loop does.
* Request timeouts (``LoadSpec.timeout_s``): a request still running that long after it was sent
  is abandoned, as ``dynamo bench``'s client gives up: its engine aborts it (its blocks are
  freed), the router forgets it, and its record ends with ``error="timeout"``. Deadlines are
  sent-time + a constant, so they are kept in a FIFO, not the heap; one due at the same instant as
  an event fires after it (the tokens of that instant arrive first).

The loop with ``_pass_start`` / ``_pass_end`` runs in C when built (``replay/_loop.c``, step for
step the same; ``DYN_NATIVE=0`` runs this Python). An ended flight keeps its record and routing.

Deterministic for a given seed: one ``random.Random`` per use, seeded from it, and no
dependence on wall-clock time or hash ordering.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from dynamo import native
from dynamo.bench.request import RequestRecord, RequestSpec
from dynamo.bench.workload import Session
from dynamo.engine_core.sequence import Sequence, new_sequence
from dynamo.frontend.disagg import prefill_remotely
from dynamo.frontend.errors import to_http
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.replay.deliver import deliver
from dynamo.replay.deployment import Deployment
from dynamo.replay.events import EventQueue
from dynamo.replay.flight import Flight, SimulationResult
from dynamo.replay.frontend_model import FrontendModel, wake_or_arrive
from dynamo.replay.load import LoadGenerator, LoadSpec, Runner, Send
from dynamo.replay.pools import (
    BUSY,
    IDLE,
    SCHEDULED,
    WORKER_ID_BASE,
    Pool,
    Rank,
    RoutingRecord,
    build_pool,
)
from dynamo.router.hashing import SharedPrefixHasher
from dynamo.router.queue import Held, QueueFull, QueuePolicy
from dynamo.runtime.errors import DynamoError
from dynamo.runtime.heap import collector_paused

_SEND, _PASS_END, _PASS_START = 0, 1, 2
# every ended flight's prompt and spec (never read or changed): no objects kept per request
_ENDED: list[int] | array[int] = []
_ENDED_SPEC = RequestSpec(max_tokens=0, expected_prompt_tokens=0)
_native_loop = native.load_optional("dynamo.replay._loop")
"""The event loop below (``_phase``'s, ``_pass_start``, ``_pass_end``) in C; None: this Python."""


class Simulation:
    """One replay run. Build it, then :meth:`run` once. ``warmup``: a first phase (its load and
    sessions) whose requests run on the same deployment but are not reported."""

    def __init__(
        self,
        deployment: Deployment,
        sessions: Iterator[Session],
        load: LoadSpec,
        *,
        decode_text: Callable[[list[int]], str] | None = None,
        warmup: tuple[LoadSpec, Iterator[Session]] | None = None,
    ) -> None:
        self.deployment = deployment
        self.load = load
        self._sessions = sessions
        self._warmup = warmup
        self._decode_text = decode_text
        self._events_queue = EventQueue()  # (when, kind, FIFO order, payload)
        self._counter = itertools.count()
        self._events = 0  # events processed in the current phase (a pass started inline counts)
        self.now = 0.0
        self.flights: list[Flight] = []
        self._by_id: dict[str, Flight] = {}
        self._timeouts: deque[tuple[float, Flight]] = deque()
        self._remote_prefills = 0  # disaggregated: prefills in flight on prefill workers
        self._prefix = "replay"
        # the virtual clock, read by the routers and the load: ``self.now`` through a C call
        # (the KV router reads it once a request; a method was a Python frame each time)
        self._clock: Callable[[], float] = partial(getattr, self, "now")
        seed = load.seed if deployment.router_seed is None else deployment.router_seed
        self.decode_pool = build_pool(
            deployment,
            deployment.decode_config(),
            deployment.workers,
            WORKER_ID_BASE,
            seed,
            "decode",
            self._clock,
        )
        self.prefill_pool = (
            build_pool(
                deployment,
                deployment.prefill_config(),
                deployment.prefill_workers,
                WORKER_ID_BASE + deployment.workers,
                seed + 1,
                "prefill",
                self._clock,
            )
            if deployment.disaggregated
            else None
        )
        self._hash_size = self.decode_pool.config.block_size
        self._hasher = SharedPrefixHasher(self._hash_size)  # a prefix group's blocks: hashed once
        self._frontend = FrontendModel(deployment.frontend_ms) if deployment.frontend_ms else None

    # -- the event loop ---------------------------------------------------------------------
    def _push(self, when: float, kind: int, payload: object) -> None:
        self._events_queue.push(when, kind, next(self._counter), payload)

    def _schedule_send(self, when: float, runner: Runner | None) -> None:
        self._events_queue.push(when, _SEND, next(self._counter), runner)

    def run(self) -> SimulationResult:
        """Both phases to their end. The collector is paused meanwhile (the run makes no cyclic
        garbage, ``tests/unit/replay/test_replay_garbage.py``), and the flights are handed to
        the result: the simulation keeps none, so no reference cycle runs through them."""
        with collector_paused():
            return self._run()

    def _run(self) -> SimulationResult:
        started = time.perf_counter()
        events = 0
        origin = 0.0
        if self._warmup is not None:
            spec, sessions = self._warmup
            self._prefix = "warmup"
            events += self._phase(spec, sessions, 0.0)
            self.flights.clear()
            origin = self.now
            self._prefix = "replay"
        events += self._phase(self.load, self._sessions, origin)
        for flight in self.flights:  # the measured phase's times count from its start
            flight.record.start -= origin
            flight.record.end -= origin
        ranks = [*self.decode_pool.ranks.values()]
        if self.prefill_pool is not None:
            ranks += self.prefill_pool.ranks.values()
        flights, self.flights = self.flights, []
        return SimulationResult(
            flights=flights,
            simulated_s=self.now - origin,
            wall_s=time.perf_counter() - started,
            passes=sum(r.passes for r in ranks),
            events=events,
            per_rank_passes={f"{r.worker_id:x}:{r.dp_rank}": r.passes for r in ranks},
            warmup_s=origin,
        )

    def _phase(self, load: LoadSpec, sessions: Iterator[Session], origin: float) -> int:
        """Run one phase of load to its end (nothing left to happen); the events processed."""
        send: Send = self._send
        pool = self.decode_pool
        if (
            _native_loop is not None
            and self._frontend is None
            and self.prefill_pool is None
            and pool.core is not None
            and pool.queue is None
        ):  # every send routed at once by the KV router: _send's path in C (replay/_loop.c)
            send = _native_loop.sender(self)
        gen = LoadGenerator(
            load,
            sessions,
            clock=self._clock,
            schedule=self._schedule_send,
            send=send,
            origin=origin,
        )
        gen.start()
        queue, timeouts = self._events_queue, self._timeouts
        pop, next_when = queue.pop, queue.next_when
        pass_end, pass_start = self._pass_end, self._pass_start
        wake: Callable[[Any], None] = gen.waker()
        if self._frontend is not None:  # a send's event may be a flight reaching the router
            wake = wake_or_arrive(wake, self._arrive)
        self._events = 0
        if _native_loop is not None:  # this loop in C (replay/_loop.c), to the phase's end:
            self._events = _native_loop.run(self, queue, timeouts, self._counter, wake, deliver)
        while queue or timeouts:
            if timeouts and timeouts[0][0] < next_when():  # (inf when the queue is empty)
                when, flight = timeouts.popleft()
                if not flight.done:
                    self.now = when
                    self._time_out(flight)
                continue
            when, kind, payload = pop()
            self.now = when
            self._events += 1
            # the payload's type follows from kind (_push / _schedule_send)
            if kind == _PASS_END:
                pass_end(payload)
            elif kind == _PASS_START:
                pass_start(payload)
            else:
                wake(payload)
        for flight in [*self._by_id.values()]:  # nothing left to run them: never completes
            flight.record.end = self.now
            flight.record.error = "incomplete"
            flight.record.error_message = "the simulation ended with the request unfinished"
            self._abandon(flight)
        return self._events

    # -- requests ---------------------------------------------------------------------------
    def _send(self, spec: RequestSpec, runner: Runner, load: LoadGenerator) -> None:
        now = self.now
        index = len(self.flights)
        prompt = spec.prompt
        if not isinstance(prompt, list | array):
            raise ValueError("the replay needs token-id prompts (completions, ids)")
        record = RequestRecord(
            start=now,
            max_tokens=spec.max_tokens,
            expected_prompt_tokens=spec.expected_prompt_tokens,
            session=spec.session,
            turn=spec.turn,
            group=spec.group,
        )
        flight = Flight(index, f"{self._prefix}-{index}", record, spec, runner, load, prompt)
        self.flights.append(flight)
        self._by_id[flight.request_id] = flight
        if load.load.timeout_s is not None:
            self._timeouts.append((now + load.load.timeout_s, flight))
        if self._frontend is not None:  # the frontend's own time first
            at = self._frontend.reaches_router(now)
            self._events_queue.push(at, _SEND, next(self._counter), flight)
            return
        self._arrive(flight)

    def _arrive(self, flight: Flight) -> None:
        """``flight`` reaches the router: hashed, then held (the router queue) or routed."""
        spec, prompt = flight.spec, flight.tokens
        hashes = self._hasher.hashes(prompt, spec.group if spec.group >= 0 else None)
        pool = self.decode_pool
        if pool.queue is not None and (len(pool.queue) or pool.core_saturated()):
            self._hold(flight, hashes)
            return
        self._route(flight, hashes)

    def _route(self, flight: Flight, hashes: tuple[list[int], list[int]]) -> None:
        prompt = flight.tokens
        try:
            rank, chosen = self.decode_pool.route(flight.request_id, prompt, *hashes)
            flight.routing = chosen
            if self.prefill_pool is not None and self._remote(self.prefill_pool, flight, chosen):
                flight.decode_rank = rank
                rank, pre = self.prefill_pool.route(flight.request_id, prompt, *hashes)
                chosen.prefill_worker_id, chosen.prefill_dp_rank = pre.worker_id, pre.dp_rank
                chosen.prefill_overlap_blocks = pre.overlap_blocks
                self._remote_prefills += 1
            seq = self._sequence(rank, flight, hashes)
        except DynamoError as exc:
            self._fail(flight, exc)
            return
        self._enqueue(rank, flight, seq)

    # -- the router queue (router/queue.py, as the live KV router holds requests) -------------
    def _hold(self, flight: Flight, hashes: tuple[list[int], list[int]]) -> None:
        """Hold ``flight`` until a worker has prefill capacity (a full queue refuses it)."""
        pool = self.decode_pool
        queue, core = pool.queue, pool.core
        assert queue is not None and core is not None
        isl = len(flight.tokens)
        cached = 0
        if queue.policy is QueuePolicy.WSPT:
            best = max(core.find_matches(hashes[0]).values(), default=0)
            cached = min(best * core.block_size, isl)
        try:
            flight.held = queue.push(flight, isl=isl, cached_tokens=cached)
        except QueueFull as exc:
            self._fail(flight, exc)
            return
        flight.hashes = hashes

    def _release_held(self) -> None:
        """Capacity may have freed: route held requests, in queue order, while it lasts."""
        pool = self.decode_pool
        if pool.queue is not None and len(pool.queue):
            pool.queue.drain(lambda _held: not pool.core_saturated(), self._release)

    def _release(self, held: Held[Flight]) -> None:
        flight = held.item
        hashes = flight.hashes
        assert hashes is not None
        flight.held, flight.hashes = None, None
        self._route(flight, hashes)

    def _time_out(self, flight: Flight) -> None:
        """The client gave up on ``flight`` (``dynamo bench``'s request timeout)."""
        record = flight.record
        record.end = self.now
        record.error = "timeout"
        timeout = flight.load.load.timeout_s
        record.error_message = f"no complete response within {timeout} s"
        self._abandon(flight)
        self._release_held()  # what it held on its worker is free

    def _abandon(self, flight: Flight) -> None:
        """End an unfinished request: its engine drops it (freeing its blocks), its routers
        forget it, its runner goes on."""
        if flight.held is not None:  # still in the router queue: it leaves it
            queue = self.decode_pool.queue
            assert queue is not None
            queue.discard(flight.held)
            flight.held, flight.hashes = None, None
        rank = flight.rank
        if rank is not None:
            rank.sched.abort(flight.request_id)  # a pass in progress: its tokens are dropped
            if rank.pool.role == "prefill":
                self._remote_prefills -= 1
                if rank.pool.core is not None:
                    rank.pool.core.free(flight.request_id)
        if self.decode_pool.core is not None:
            self.decode_pool.core.free(flight.request_id)
        self._finish(flight)

    def _remote(self, prefill: Pool, flight: Flight, decode: RoutingRecord) -> bool:
        """Disaggregated: whether the prompt is prefilled on a worker of ``prefill`` (the
        frontend's conditional-disaggregation rule, on the decode worker's reported prefix)."""
        cached = decode.overlap_blocks * self._hash_size
        queue = max(0, self._remote_prefills - len(prefill.cards))
        return prefill_remotely(self.deployment.disagg, len(flight.tokens), cached, queue)

    def _sequence(
        self,
        rank: Rank,
        flight: Flight,
        hashes: tuple[list[int], list[int]],
        *,
        handoff: DisaggregatedParams | None = None,
    ) -> Sequence:
        return new_sequence(
            rank.pool.config,
            flight.tokens,
            flight.request_id,
            self.now,
            max_tokens=flight.spec.max_tokens,
            ignore_eos=True,
            handoff=handoff,
            hashes=hashes,
        )

    def _enqueue(self, rank: Rank, flight: Flight, seq: Sequence) -> None:
        flight.rank = rank
        rank.sched.enqueue(seq)
        if rank.state == IDLE:
            rank.state = SCHEDULED
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
    def _pass_start(self, rank: Rank) -> None:
        sched = rank.sched
        out = sched.step(self.now)
        if out.is_empty:
            rank.state = IDLE
            ready = sched.next_ready_at()
            if ready is not None:  # every runnable request waits for its KV transfer
                rank.state = SCHEDULED
                self._push(max(ready, self.now), _PASS_START, rank)
            return
        rank.passes += 1
        rank.out = out
        rank.state = BUSY
        self._push(self.now + out.duration, _PASS_END, rank)

    def _pass_end(self, rank: Rank) -> None:
        out = rank.out
        assert out is not None
        rank.out = None
        now = self.now
        pool = rank.pool
        core = pool.core
        if core is not None and out.events:
            core.apply_events(rank.worker_id, out.events)
        by_id = self._by_id
        prefill_pool = pool.role == "prefill"
        if not prefill_pool:  # the tokens' TTFT / ITL accounting, in one call
            firsts = deliver(out.tokens, by_id, now)
            if firsts is not None and core is not None:
                for flight in firsts:
                    core.prefill_completed(flight.request_id)
        if out.finished:
            self._retire(rank, out.finished)
        held = pool.queue is not None and not prefill_pool and len(pool.queue) > 0
        if not rank.sched.has_work:
            rank.state = IDLE
            if held:
                self._release_held()  # prefills completed, requests ended: capacity for the held
            return
        # The next pass starts now, after every arrival and pass end of this instant and after
        # the pass starts already due (its place in the FIFO is taken here, as a push would).
        rank.state = SCHEDULED
        order = next(self._counter)
        if held:
            self._release_held()
        queue = self._events_queue
        if queue.next_when() <= now:  # more is due at this instant: the pass waits its turn
            queue.push(now, _PASS_START, order, rank)
        else:  # nothing else is due now: the pop would be the very next event
            self._events += 1
            self._pass_start(rank)

    def _retire(self, rank: Rank, finished: list[Sequence]) -> None:
        """The requests that finished in ``rank``'s pass ending now: the router frees them;
        a prefill moves to its decode worker, any other request's record is complete."""
        now, by_id, core = self.now, self._by_id, rank.pool.core
        prefill_pool = rank.pool.role == "prefill"
        for seq in finished:
            flight = by_id.get(seq.request_id)
            if flight is None:
                continue
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
            reason = seq.finish_reason
            # a StrEnum's str is its value (``.value`` is a Python-level enum property: 0.3 µs)
            record.finish_reason = "length" if reason is None else str(reason)
            if self._decode_text is not None:
                record.text = self._decode_text(seq.output)
            self._finish(flight)

    def _to_decode(self, flight: Flight, seq: Sequence, prefill_rank: Rank) -> None:
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
        self._enqueue(rank, flight, dseq)

    def _finish(self, flight: Flight) -> None:
        """The request ended (done, failed or abandoned): its load phase goes on."""
        flight.done = True
        del self._by_id[flight.request_id]
        flight.tokens, flight.spec = _ENDED, _ENDED_SPEC  # what ended requests sent: not kept
        flight.load.ended(flight.runner, flight.record, self.now)

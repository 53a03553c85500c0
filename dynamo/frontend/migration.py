"""Request migration (FACTS §7, spec 002): continue a failed stream on another instance.

When an attempt (``attempt.py``) fails with a *migratable* error while the request's context is
live, the choice's loop of attempts asks its :class:`Migration` for another try. The migration
knows every token the client has already been sent; the next attempt sends the same request
(same request id, so a deterministic engine continues with the same ids) with those tokens
appended to the prompt and ``max_tokens`` / ``min_tokens`` reduced by them. The client sees one
stream: the tokens before the failure, then the continuation, with one terminal.

Migratable: the instance could not be reached or went away (``CannotConnect``,
``ConnectionTimeout``, ``Disconnected``, ``NoInstances`` from the transport), the stream ended
without ``complete_final`` (``StreamIncomplete``), the instance stopped answering
(``ResponseTimeout``), it is shutting down (``EngineShutdown``, ``WorkerShutdown``) or it is
overloaded (``Overloaded``); in disaggregated serving, the prefill worker failed (the same
errors from the remote prefill; the decode worker could not fetch the KV: ``KVTransferFailed``).
Never: cancellation (``Cancelled``, or the context stopped), invalid input, engine errors, and
requests whose output depends on the whole prompt being the client's (guided decoding, as the
reference; prompt log-probabilities).

The limit is the frontend's ``--migration-limit`` when set, else what the model's workers
advertise in their cards. ``DYN_MIGRATION_MAX_SEQ_LEN``: once prompt + generated exceeds it
(equal is still fine) the request stops being migratable.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec

from dynamo.observability.metrics import FrontendMetrics
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.context import Context
from dynamo.runtime.deferred_log import log_later
from dynamo.runtime.errors import (
    CannotConnect,
    ConnectionTimeout,
    Disconnected,
    DynamoError,
    EngineShutdown,
    KVTransferFailed,
    NoInstances,
    Overloaded,
    ResponseTimeout,
    StreamIncomplete,
    WorkerShutdown,
)

log = logging.getLogger(__name__)

INSTANCE_FAULTS: tuple[type[DynamoError], ...] = (
    CannotConnect,
    ConnectionTimeout,
    Disconnected,
    NoInstances,
    StreamIncomplete,
    ResponseTimeout,
    EngineShutdown,
    WorkerShutdown,
)
"""Failures of an attempt that implicate its instance: it leaves routing at once."""

MIGRATABLE: tuple[type[DynamoError], ...] = (*INSTANCE_FAULTS, Overloaded, KVTransferFailed)
"""``KVTransferFailed``: the decode worker could not fetch the prompt's KV from its prefill
worker; the decode worker is fine (it stays in routing) and a new attempt prefills again."""


def is_instance_fault(exc: BaseException) -> bool:
    return isinstance(exc, INSTANCE_FAULTS)


def is_migratable(exc: BaseException) -> bool:
    return isinstance(exc, MIGRATABLE)


@dataclass(frozen=True, slots=True)
class MigrationPolicy:
    """The frontend's migration settings (``--migration-limit``, ``DYN_MIGRATION_MAX_SEQ_LEN``).

    ``limit`` None: each model's limit comes from its workers' cards."""

    limit: int | None = None
    max_seq_len: int | None = None
    metrics: FrontendMetrics | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 0:
            raise ValueError("the migration limit must be >= 0")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError("the migration max sequence length must be >= 1")

    def effective_limit(self, model_limit: int) -> int:
        return model_limit if self.limit is None else self.limit

    def start(self, model: str, request: PreprocessedRequest, model_limit: int) -> Migration:
        """The migration state of one choice of a request."""
        limit = self.effective_limit(model_limit)
        if request.sampling.guided_decoding is not None or request.output.prompt_logprobs:
            limit = 0
        return Migration(self, model, request, limit)


class Migration:
    """One choice's migration state: the request to send next, the tokens the client has been
    sent, and the retries left. Owned by the choice's loop of attempts (``attempt.attempts``)."""

    __slots__ = (
        "_policy",
        "_model",
        "_original",
        "_generated",
        "_tracking",
        "request",
        "retries_left",
        "migrations",
        "first_migration_at",
    )

    def __init__(
        self, policy: MigrationPolicy, model: str, request: PreprocessedRequest, limit: int
    ) -> None:
        self._policy = policy
        self._model = model
        self._original = request
        self._generated: list[int] = []
        self._tracking = limit > 0
        self.request = request
        self.retries_left = limit
        self.migrations = 0
        self.first_migration_at: float | None = None

    @property
    def generated(self) -> int:
        """Tokens received so far (over every attempt)."""
        return len(self._generated)

    @property
    def remaining_max_tokens(self) -> int | None:
        """``max_tokens`` left for a continuation (None: the request sets no limit)."""
        max_tokens = self._original.stop.max_tokens
        return None if max_tokens is None else max_tokens - len(self._generated)

    def record(self, outputs: list[LLMEngineOutput]) -> None:
        """Outputs the client is about to receive: their tokens join the continuation prompt."""
        if not self._tracking:
            return
        for out in outputs:
            if out.token_ids:
                self._generated += out.token_ids
        limit = self._policy.max_seq_len
        if limit is not None and len(self._original.token_ids) + len(self._generated) > limit:
            self._tracking = False  # too long to re-prefill elsewhere: fail like an unmigrated one
            self._generated = []
            m = self._policy.metrics
            if m is not None:
                m.model_migration_max_seq_len_exceeded.labels(self._model).inc()

    def retry(self, exc: BaseException, ctx: Context, received: bool) -> bool:
        """Whether to continue on another instance after ``exc``; if so, :attr:`request` is the
        continuation. ``received``: the failed attempt delivered a response first."""
        if not self._tracking or self.retries_left <= 0 or not is_migratable(exc):
            return False
        if ctx.is_stopped() or ctx.is_killed():
            return False
        self.retries_left -= 1
        self.migrations += 1
        if self.first_migration_at is None:
            self.first_migration_at = time.monotonic()
        self.request = self._continuation()
        kind = "ongoing_request" if received else "new_request"
        m = self._policy.metrics
        if m is not None:
            m.model_migration.labels(self._model, kind).inc()
        # Written after the continuation has been sent (a failed instance fails its streams in
        # one burst: their continuations leave in one flush, not after every line is written).
        log_later(
            log,
            logging.INFO,
            "migrating request %s (%s, %d tokens generated, %d retries left): %s",
            self._original.request_id,
            kind,
            len(self._generated),
            self.retries_left,
            exc,
        )
        return True

    def finish(self, outcome: str) -> None:
        """The choice ended (``success``, ``failure`` or ``cancelled``)."""
        m = self._policy.metrics
        if self.first_migration_at is not None and m is not None:
            m.model_migration_duration.labels(outcome).observe(
                time.monotonic() - self.first_migration_at
            )

    def _continuation(self) -> PreprocessedRequest:
        original = self._original
        if not self._generated:
            return msgspec.structs.replace(original, prefill_result=None)
        n = len(self._generated)
        stop = original.stop
        new_stop = msgspec.structs.replace(
            stop,
            max_tokens=None if stop.max_tokens is None else max(stop.max_tokens - n, 0),
            min_tokens=None if stop.min_tokens is None else max(stop.min_tokens - n, 0),
        )
        return msgspec.structs.replace(
            original,
            token_ids=[*original.token_ids, *self._generated],
            stop=new_stop,
            # The KV a prefill worker handed over covered the old prompt only: the new
            # instance computes the longer prompt itself.
            prefill_result=None,
        )


NO_MIGRATION = MigrationPolicy(limit=0)
"""Migration off (tests and callers that do not migrate)."""

"""The mocker's per-pass debug lines (``DYN_LOG=dynamo.mocker.engine=debug``): when a pass with
prefill work starts and where a request's first token's time went. ``benchmarks/faults.py``
reads them to split a migration's gap into its parts; nothing else depends on them. Callers
check ``log.isEnabledFor(logging.DEBUG)`` first: the lines cost nothing when off."""

from __future__ import annotations

import logging

from dynamo.engine_core.sequence import Sequence
from dynamo.mocker.simulator import StepOutput
from dynamo.runtime.deferred_log import log_later

# The engine's logger: the lines are the engine's, and DYN_LOG filters and the benchmark name it.
log = logging.getLogger("dynamo.mocker.engine")


def prefill_pass(out: StepOutput, now: float) -> None:
    """A pass with prefill work starts (debug; the fault benchmark reads it to know when the
    next token of a killed worker's streams was due: at the end of such a pass in progress).
    Written at once, not later: the worker may be killed before the pass ends."""
    log.debug(
        "prefill pass: ends_in_ms=%.3f pass_ms=%.3f pass_prefill_tokens=%d decodes=%d",
        (out.start + out.duration - now) * 1000,
        out.duration * 1000,
        out.num_prefill_tokens,
        out.num_decodes,
    )


def first_token(seq: Sequence, out: StepOutput, now: float) -> None:
    """Where a request's time to first token went on this worker (debug; the fault benchmark
    reads it to split a migration's gap): waiting for the pass in progress, the modelled pass
    that produced the token, and how late the loop delivered it (CPU starvation). Written once
    the pass's tokens have left (``log_later``): the measurement must not delay what it
    measures."""
    end = out.start + out.duration
    log_later(
        log,
        logging.DEBUG,
        "first token of %s: queued_ms=%.3f pass_ms=%.3f late_ms=%.3f pass_prefill_tokens=%d "
        "prompt_tokens=%d cached_tokens=%d decodes=%d",
        seq.request_id,
        (out.start - seq.arrival) * 1000,
        out.duration * 1000,
        (now - end) * 1000,
        out.num_prefill_tokens,
        seq.num_prompt_tokens,
        seq.num_cached_tokens or 0,
        out.num_decodes,
        turns=3,
    )

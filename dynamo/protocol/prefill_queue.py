"""The global prefill queue's wire types (disaggregation, dispatch ``queue``, spec 003)."""

from __future__ import annotations

import msgspec

from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest


class PrefillTask(msgspec.Struct, frozen=True, kw_only=True):
    """One item of a model's global prefill queue (dispatch ``queue``, spec 003): the
    prefill-only request, and where its outcome goes (the frontend instance ``reply_to`` of
    endpoint ``{namespace}.frontend.prefill_reply``, under the id ``task_id``)."""

    task_id: str
    reply_to: int
    request: PreprocessedRequest


class PrefillReply(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill worker's answer to a :class:`PrefillTask`: the prefill's terminal chunk (its
    handoff, or ``finish_reason`` error) or the typed error that ended it (``error_kind``,
    ``error``), and the worker that ran it."""

    task_id: str
    worker_id: int
    output: LLMEngineOutput | None = None
    error_kind: str | None = None
    error: str | None = None


REPLY_COMPONENT = "frontend"
REPLY_ENDPOINT = "prefill_reply"


def queue_name(model: str) -> str:
    """The work queue (``DistributedRuntime.work_queue``) of ``model``'s prefill tasks."""
    return f"prefill.{model}"

"""The stream validator: exactly one terminal ends every engine stream, and nothing follows it.

In strict mode (the spec's debug validator: tests, engine development) a violation raises
:class:`StreamContractViolation` loudly. Otherwise it is logged and repaired: chunks after the
terminal are dropped, and a stream that ends without a terminal gets an ``error`` terminal, so a
client never sees a silently short stream. Strict mode is switched on by
``WorkerConfig.strict_validation`` (the worker flag ``--strict-stream-validation``, env twin
``DYN_STRICT_STREAM_VALIDATION``).
"""

from __future__ import annotations

import logging

from dynamo.backend.engine import chunk
from dynamo.protocol.output import LLMEngineOutput
from dynamo.runtime.errors import Unknown

log = logging.getLogger(__name__)


class StreamContractViolation(Unknown):
    """An engine broke the response contract of spec 000."""


class StreamValidator:
    __slots__ = ("strict", "request_id", "terminated", "num_chunks")

    def __init__(self, request_id: str, *, strict: bool) -> None:
        self.strict = strict
        self.request_id = request_id
        self.terminated = False
        self.num_chunks = 0

    def accept(self, output: LLMEngineOutput) -> bool:
        """True if ``output`` may be forwarded; False if it must be dropped."""
        if self.terminated:
            message = f"request {self.request_id}: chunk after terminal"
            if self.strict:
                raise StreamContractViolation(message)
            log.error(message)
            return False
        self.num_chunks += 1
        if output.finish_reason is not None:
            self.terminated = True
        return True

    def finish(self) -> LLMEngineOutput | None:
        """Call when the engine's stream ends; returns a repair terminal if one is needed."""
        if self.terminated:
            return None
        message = f"request {self.request_id}: engine stream ended without a terminal chunk"
        if self.strict:
            raise StreamContractViolation(message)
        log.error(message)
        return chunk.error(message)

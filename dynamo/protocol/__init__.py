"""Wire types: everything that crosses a process boundary (msgspec only).

This package imports only the standard library and msgspec.
"""

from dynamo.protocol.annotated import Annotated
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.output import FinishReason, LLMEngineOutput, Usage
from dynamo.protocol.request import (
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
    TraceLink,
)

__all__ = [
    "Annotated",
    "DisaggregatedParams",
    "FinishReason",
    "LLMEngineOutput",
    "PreprocessedRequest",
    "RoutingHints",
    "SamplingOptions",
    "StopConditions",
    "TraceLink",
    "Usage",
]

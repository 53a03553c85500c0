"""Disaggregation roles of a worker."""

from __future__ import annotations

from enum import StrEnum


class DisaggregationMode(StrEnum):
    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def component(self) -> str:
        """The component a worker of this role registers under (prefill workers apart)."""
        return "prefill" if self is DisaggregationMode.PREFILL else "backend"

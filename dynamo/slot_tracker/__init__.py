"""Standalone slot tracker (spec 001): the KV router's active-load accounting as an HTTP service.

``python -m dynamo.slot_tracker --port 8091``; consumers register workers, report request
lifecycles and read advisory loads. Optional replica sync between trackers over ZMQ.
"""

from __future__ import annotations

from dynamo.slot_tracker.config import SlotTrackerConfig
from dynamo.slot_tracker.service import SlotTrackerService

__all__ = ["SlotTrackerConfig", "SlotTrackerService"]

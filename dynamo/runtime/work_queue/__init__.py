"""The work queue: items pushed by producers, each pulled and acknowledged by one consumer."""

from dynamo.runtime.work_queue.base import QueueDepth, WorkItem, WorkQueue

__all__ = ["QueueDepth", "WorkItem", "WorkQueue"]

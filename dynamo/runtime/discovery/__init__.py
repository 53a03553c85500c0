"""Discovery: an etcd-shaped key-value store with leases and prefix watches."""

from dynamo.runtime.discovery.base import (
    Discovery,
    KeyValue,
    Lease,
    Watch,
    WatchEvent,
    WatchEventKind,
)

__all__ = ["Discovery", "KeyValue", "Lease", "Watch", "WatchEvent", "WatchEventKind"]

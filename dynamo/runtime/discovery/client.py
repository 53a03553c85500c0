"""``DiscoveryClient``: what every discovery backend's client keeps the same way.

A client (one per process) owns the leases it granted and the watches it opened; once closed it
refuses every call (``CannotConnect``), and closing it ends its watches, then revokes its leases,
so that its keys vanish at once rather than at their TTL. The memory, file and etcd backends
differ in where keys live, not in this.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from dynamo.runtime.discovery.base import Lease
from dynamo.runtime.discovery.watch import QueueWatch
from dynamo.runtime.errors import CannotConnect

LeaseT = TypeVar("LeaseT", bound=Lease)


class DiscoveryClient(Generic[LeaseT]):
    """The leases and watches of one client, and whether it is closed. A backend's calls begin
    with :meth:`_check_open`; its ``close()`` sets ``_closed`` and then :meth:`_release`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._leases: list[LeaseT] = []
        self._watches: list[QueueWatch] = []
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise CannotConnect(f"{self._name} is closed")

    def _forget_watch(self, watch: QueueWatch) -> None:
        """A watch's ``on_close``: its consumer closed it, nothing is left to end."""
        if watch in self._watches:
            self._watches.remove(watch)

    async def _release(self) -> None:
        """End the watches, then revoke the leases (their keys are deleted)."""
        for watch in list(self._watches):
            await watch.close()
        for lease in self._leases:
            await lease.revoke()
        self._leases.clear()

"""Names: ``namespace.component.endpoint`` addresses, instance ids and discovery keys."""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

_PART = re.compile(r"^[A-Za-z0-9_\-]+$")


@dataclass(frozen=True, slots=True)
class EndpointId:
    namespace: str
    component: str
    endpoint: str

    def __post_init__(self) -> None:
        for part in (self.namespace, self.component, self.endpoint):
            if not _PART.match(part):
                raise ValueError(f"invalid name part {part!r} (letters, digits, '_' and '-' only)")

    @classmethod
    def parse(cls, text: str) -> EndpointId:
        """Parse ``ns.comp.ep`` or ``dyn://ns.comp.ep``."""
        body = text.removeprefix("dyn://")
        parts = body.split(".")
        if len(parts) != 3:
            raise ValueError(f"endpoint must be namespace.component.endpoint, got {text!r}")
        return cls(*parts)

    @property
    def path(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"

    def __str__(self) -> str:
        return f"dyn://{self.path}"

    def instance_path(self, instance_id: int) -> str:
        """The request-plane route of one instance: several instances of one endpoint may live
        in one process (``--num-workers``), each with its own handler."""
        return f"{self.path}/{instance_id:x}"

    def instances_prefix(self) -> str:
        """Discovery prefix under which this endpoint's instances are registered."""
        return f"v1/instances/{self.namespace}/{self.component}/{self.endpoint}/"

    def instance_key(self, instance_id: int) -> str:
        return f"{self.instances_prefix()}{instance_id:x}"

    def model_card_key(self, instance_id: int) -> str:
        return f"v1/mdc/{self.namespace}/{self.component}/{self.endpoint}/{instance_id:x}"


def model_cards_prefix(namespace: str) -> str:
    return f"v1/mdc/{namespace}/"


def disagg_router_prefix(namespace: str) -> str:
    """Run-time disaggregation thresholds, one key per model (the frontends watch it)."""
    return f"v1/disagg_router/{namespace}/"


def event_publishers_prefix(namespace: str) -> str:
    return f"v1/event_plane/{namespace}/"


def new_instance_id() -> int:
    """A random positive 63-bit id (unique across processes with overwhelming probability)."""
    return random.SystemRandom().getrandbits(63) or os.getpid()

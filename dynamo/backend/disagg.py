"""Disaggregation roles of a worker: the role type is the model card's
:class:`~dynamo.protocol.model_card.WorkerRole` (one type for the whole code base); this module
says where each role registers."""

from __future__ import annotations

from dynamo.protocol.model_card import WorkerRole


def role_component(role: WorkerRole) -> str:
    """The component a worker of ``role`` registers under (prefill workers apart)."""
    return "prefill" if role is WorkerRole.PREFILL else "backend"

"""Type stub of the native module ``dynamo.slot_tracker._loads`` (source: ``_loads.c``)."""

from collections.abc import Mapping

def potential_loads(trackers: Mapping[tuple[str, str], object], body: bytes) -> bytes | None:
    """The 200 answer of POST /potential_loads for ``body``, or None: the app answers it."""

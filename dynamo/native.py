"""Which implementation of each native helper this process uses: decided once, at import.

Two hot spots have C extensions (``dynamo.router._blocks``, ``dynamo.runtime._sender``), each
with a pure-Python fallback of the same contract (``*_fallback``), so the package installs and
runs where the extensions cannot be built (they are optional in the build). A third,
``dynamo.pytorch._paged_attn``, is a kernel whose fallback is the caller's own torch code
(``load_optional``). ``DYN_NATIVE=0``
forces every fallback (one CI pass runs the suites that way); otherwise a native module is used
whenever it imports.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Final

log = logging.getLogger(__name__)

ENV: Final = "DYN_NATIVE"
WANTED: Final[bool] = os.environ.get(ENV, "1").strip().lower() not in {"0", "false", "no", "off"}
"""False when ``DYN_NATIVE`` is 0/false/no/off: every native helper uses its fallback."""


def load(native: str, fallback: str) -> ModuleType:
    """The module ``native`` if wanted and built, else ``fallback`` (both full module names)."""
    if WANTED:
        try:
            return importlib.import_module(native)
        except ImportError as exc:  # not built here: the fallback is the same contract
            log.warning("%s is not available (%s): using %s", native, exc, fallback)
    return importlib.import_module(fallback)


def load_optional(native: str) -> ModuleType | None:
    """The module ``native`` if wanted and built, else None (the caller has its own fallback)."""
    if WANTED:
        try:
            return importlib.import_module(native)
        except ImportError as exc:
            log.warning("%s is not available (%s): using the fallback", native, exc)
    return None

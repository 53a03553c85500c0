"""Which implementation of each native helper this process uses: decided once, at import.

The hot loops have C extensions, optional in the build, so the package installs and runs where
they cannot be built:

* with a pure-Python fallback of the same contract (``*_fallback``, chosen by :func:`load`):
  ``router._blocks`` (load accounting), ``router._hash`` (block hashes), ``router._cost`` (the
  KV router's cost per candidate), ``router._route`` (the KV router's choice among all of its
  targets in one call), ``router._apply_raw`` (the KV indexer's in-order raw events buffer:
  the id check, the tree's call and the counters in one call), ``router._route_record`` (the
  KV router's common request routed and recorded in one call), ``router._active`` (a
  request's load into and out of ``ActiveSequences``), ``router._radix`` (the KV
  prefix tree: a native table of blocks; the fallback keeps path-compressed runs),
  ``runtime._sender`` (write-behind), ``engine_core._pass`` and ``engine_core._kv`` (the
  scheduler pass's loops and the KV manager: a native table; the fallback keeps Python
  containers), ``engine_core._sequence``
  (a request's ``Sequence`` built at its slot offsets, without its ``__init__``),
  ``bench._draw`` (the workloads' random words: ``random.choices``' draws),
  ``replay._events`` (the replay's event queue; the fallback is heapq), ``replay._deliver``
  (a replay pass's tokens into the requests' records), ``bench._stats`` (the report's order
  statistics of a series and its pass over the records; the fallback sorts the Python list),
  ``replay._report`` (the replay report's pass over its flights);
* as a fast path beside the Python code that stays the reference (:func:`load_optional`, the
  caller keeps its own path): ``runtime._http`` (plain HTTP/1.1 requests; httptools otherwise),
  ``slot_tracker._loads`` (``/potential_loads``), ``pytorch._paged_attn`` (decode attention) and
  ``replay._loop`` (the replay's event loop).

``DYN_NATIVE=0`` forces every fallback (one CI pass, ``make test-fallback``, runs the suites that
way); otherwise a native module is used whenever it imports."""

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


def load(native: str, fallback: str, *, requires: tuple[str, ...] = ()) -> ModuleType:
    """The module ``native`` if wanted and built, else ``fallback`` (both full module names).

    ``requires``: names the contract has; a native build without one of them is stale (built
    from an older source: rebuild it) and the fallback is used, with a warning."""
    if WANTED:
        try:
            module = importlib.import_module(native)
        except ImportError as exc:  # not built here: the fallback is the same contract
            log.warning("%s is not available (%s): using %s", native, exc, fallback)
        else:
            missing = [name for name in requires if not hasattr(module, name)]
            if not missing:
                return module
            log.warning(
                "%s is a stale build (no %s; rebuild it): using %s",
                native,
                ", ".join(missing),
                fallback,
            )
    return importlib.import_module(fallback)


def load_optional(native: str) -> ModuleType | None:
    """The module ``native`` if wanted and built, else None (the caller has its own fallback)."""
    if WANTED:
        try:
            return importlib.import_module(native)
        except ImportError as exc:
            log.warning("%s is not available (%s): using the fallback", native, exc)
    return None

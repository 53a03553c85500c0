"""The import layering of ARCHITECTURE.md, checked on the source (no imports executed).

protocol <- runtime <- {preprocess, router, backend, observability} <- engine_core (the shared
scheduler and KV block manager) <- {frontend, mocker, pytorch, vllm, slot_tracker, bench}.
``protocol`` imports only the standard library and msgspec. ``engine_core`` imports only
protocol, runtime and router; only ``pytorch`` imports torch. Nothing imports frontend, mocker
or an engine package (except their own modules and the top-level CLI / serve composition
roots). ``router`` never imports a concrete event-plane backend.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "dynamo"

LEVEL = {
    "protocol": 0,
    "runtime": 1,
    "preprocess": 2,
    "router": 2,
    "backend": 2,
    "observability": 2,
    "engine_core": 3,
    "frontend": 4,
    "mocker": 4,
    "pytorch": 4,
    "vllm": 4,
    "slot_tracker": 4,
    "bench": 4,
}
# Composition roots that may wire top-level packages together.
ROOTS = {"cli", "serve", "serve_args", "serve_inprocess", "__main__", "replay"}
# (``replay`` composes a deployment offline: the mocker, the routers, bench's workloads.)
TOP = {"frontend", "mocker", "pytorch", "vllm", "slot_tracker", "bench", "replay"}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0].removesuffix(".py") if rel else ""


def test_layering() -> None:
    violations: list[str] = []
    for path in ROOT.rglob("*.py"):
        pkg = _package_of(path)
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "dynamo" or len(parts) < 2:
                continue
            target = parts[1]
            if pkg in ROOTS or target == pkg:
                continue
            if target in TOP:
                violations.append(f"{path.relative_to(ROOT)} imports top-level package {name}")
            elif pkg in LEVEL and target in LEVEL and LEVEL[target] >= LEVEL[pkg] and pkg != target:
                if not (LEVEL[target] == LEVEL[pkg] == 2):
                    violations.append(f"{path.relative_to(ROOT)} imports upward {name}")
    assert not violations, "\n".join(violations)


def test_protocol_imports_only_stdlib_and_msgspec() -> None:
    allowed = set(sys.stdlib_module_names) | {"msgspec", "dynamo"}
    bad = []
    for path in (ROOT / "protocol").rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in allowed:
                bad.append(f"{path.name}: {name}")
            if top == "dynamo" and not name.startswith("dynamo.protocol"):
                bad.append(f"{path.name}: {name}")
    assert not bad, bad


def test_router_sees_only_event_plane_interface() -> None:
    bad = []
    for path in (ROOT / "router").rglob("*.py"):
        for name in _imports(path):
            if name.startswith("dynamo.runtime.event_plane.") and not name.endswith(".base"):
                bad.append(f"{path.name}: {name}")
    assert not bad, bad


def test_engine_core_imports_only_protocol_runtime_router() -> None:
    allowed = {"protocol", "runtime", "router", "engine_core"}
    bad = []
    for path in (ROOT / "engine_core").rglob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "dynamo" and len(parts) > 1 and parts[1] not in allowed:
                bad.append(f"{path.name}: {name}")
    assert not bad, bad


def test_torch_is_imported_only_by_the_engines_that_run_it() -> None:
    """torch is the `pytorch` extra: only our PyTorch engine and the vLLM backend (vLLM is
    built on torch; its KV connector reads vLLM's cache tensors) may import it."""
    bad = []
    for path in ROOT.rglob("*.py"):
        if _package_of(path) in {"pytorch", "vllm"}:
            continue
        for name in _imports(path):
            if name.split(".")[0] in {"torch", "safetensors"}:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad

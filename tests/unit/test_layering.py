"""The import layering of ARCHITECTURE.md, checked on the source (no imports executed).

protocol <- runtime <- {preprocess, router, backend, observability} <- {frontend, mocker,
slot_tracker, bench, engines}. ``protocol`` imports only the standard library and msgspec.
Nothing imports frontend, mocker or an engine package (except their own modules and the
top-level CLI / serve composition roots). ``router`` never imports a concrete event-plane backend.
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
    "frontend": 3,
    "mocker": 3,
    "slot_tracker": 3,
    "bench": 3,
}
# Composition roots that may wire top-level packages together.
ROOTS = {"cli", "serve", "serve_args", "serve_inprocess", "__main__"}
TOP = {"frontend", "mocker", "slot_tracker", "bench"}


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

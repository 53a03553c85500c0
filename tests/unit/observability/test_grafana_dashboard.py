"""The Grafana dashboard in deploy/grafana parses and queries only metric families we export."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SUFFIXES = ("_bucket", "_total", "_count", "_sum")


def test_every_panel_queries_an_exported_family() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "dynamo-py.json").read_text())
    source = "\n".join(p.read_text() for p in (ROOT / "dynamo").rglob("*.py"))
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    names = {m for e in exprs for m in re.findall(r"\bdynamo_[a-z_]+", e)}
    missing = []
    for name in sorted(names):
        family = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)
        if family.startswith("dynamo_frontend_"):
            declared = f'{{p}}_{family.removeprefix("dynamo_frontend_")}"' in source
        else:
            declared = f'"{family}"' in source
        if not declared:
            missing.append(name)
    assert not missing, missing

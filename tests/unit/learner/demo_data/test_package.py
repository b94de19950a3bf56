"""`learner.demo_data` is demo code: no product module (learner/, rollout_server/, shared_schemas/ outside
this package) imports it, so the product works without it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_product_never_imports_demo_data() -> None:
    demo = REPO / "learner" / "demo_data"
    offenders = [
        str(path.relative_to(REPO))
        for package in ("learner", "rollout_server", "shared_schemas")
        for path in sorted((REPO / package).rglob("*.py"))
        if demo not in path.parents
        and any(
            name == "learner.demo_data" or name.startswith("learner.demo_data.") for name in _imports(path)
        )
    ]
    assert offenders == []

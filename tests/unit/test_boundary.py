"""The process boundary (docs/ARCHITECTURE.md#the-two-services): imports flow
`rollout_server → shared_schemas ← learner`. No module of `learner/` imports `rollout_server` when it is
imported, no module of `rollout_server/` imports `learner`, and `shared_schemas/` imports neither. What both
processes run lives in `shared_schemas` (`shared_schemas/torch_common/`, `shared_schemas/vlm_shim/`); an
import inside a function (the colocated backends building the server's engine classes) or under `if
TYPE_CHECKING:` is allowed, since it runs only when that code does.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.fresh_imports import loaded_modules

REPO = Path(__file__).resolve().parents[2]

RULES = {
    "learner": ("rollout_server",),
    "rollout_server": ("learner",),
    "shared_schemas": ("learner", "rollout_server"),
}
"""Package → the top-level packages none of its modules may import at module level."""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(source: str) -> Iterator[tuple[int, str]]:
    """`(line, imported module)` of every import that runs when the module is imported: module statements,
    nested in `if`/`try`/`with`/loops and class bodies, but not in function bodies or `if TYPE_CHECKING:`."""

    def walk(statements: list[ast.stmt]) -> Iterator[tuple[int, str]]:
        for node in statements:
            if isinstance(node, ast.Import):
                yield from ((node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0 and node.module:
                    yield node.lineno, node.module
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    yield from walk(node.body)
                yield from walk(node.orelse)
            elif isinstance(node, ast.Try | ast.TryStar):
                yield from walk(node.body)
                for handler in node.handlers:
                    yield from walk(handler.body)
                yield from walk(node.orelse)
                yield from walk(node.finalbody)
            elif isinstance(node, ast.With | ast.AsyncWith | ast.For | ast.AsyncFor | ast.While):
                yield from walk(node.body)
                yield from walk(getattr(node, "orelse", []))
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body)

    yield from walk(ast.parse(source).body)


def test_the_checker_sees_what_runs_at_import() -> None:
    source = (
        "import rollout_server.errors\n"
        "from typing import TYPE_CHECKING\n"
        "try:\n    from rollout_server import app\nexcept ImportError:\n    pass\n"
        "if TYPE_CHECKING:\n    from rollout_server.engines import base\n"
        "class A:\n    from rollout_server import config\n"
        "def f():\n    from rollout_server.engines.vllm import engine\n"
    )
    found = [name for _, name in module_level_imports(source)]
    assert found == ["rollout_server.errors", "typing", "rollout_server", "rollout_server"]


@pytest.mark.parametrize("package", sorted(RULES))
def test_no_module_level_import_across_the_boundary(package: str) -> None:
    forbidden = RULES[package]
    offenders = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, name in module_level_imports(path.read_text(encoding="utf-8")):
            if name.split(".")[0] in forbidden:
                offenders.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not offenders, (
        f"{package}/ must not import {' or '.join(forbidden)} at module level (docs/ARCHITECTURE.md"
        "#the-two-services); move what both processes use into shared_schemas, or import inside the"
        " function that needs it:\n" + "\n".join(offenders)
    )


def test_learner_modules_that_used_the_server_load_none_of_it() -> None:
    """The three modules that imported `rollout_server` before the shared code moved, plus the transports
    package, the colocated backends' package and the kernels (packed attention), in a fresh interpreter: no
    `rollout_server` module loaded."""
    modules = [
        "learner.policy",
        "learner.data.prompt_encoding",
        "learner.weights.group_send",
        "learner.weights.transports",
        "learner.rollout.colocate",
        "learner.kernels",
    ]
    assert loaded_modules(modules, {"rollout_server"}) == []

"""Benches and scripts call the product's public names only (docs/STYLE: "Benches and scripts call public
product functions; they hold no product logic and touch no `_private` name"): no module of `bench/` or
`scripts/` imports a `_private` name (or a name from a `_private` module) of `learner`, `rollout_server` or
`shared_schemas`, reads one as an attribute of something it imported from them (`pa._register()`,
`learner.kernels._x`), or fetches one with `getattr(..., "_x")`. Dunder names (`__version__`) are public.
A module's own tests may reach its private names; these files may not.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PRODUCT = ("learner", "rollout_server", "shared_schemas")
"""Top-level packages of the product."""

SCANNED = ("bench", "scripts")
"""Directories whose Python files must keep to the product's public names."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_product(module: str) -> bool:
    return module.split(".")[0] in PRODUCT


def private_uses(source: str) -> Iterator[tuple[int, str]]:
    """`(line, what)` for every use of a `_private` product name in `source` (see the module docstring)."""
    tree = ast.parse(source)
    bound: set[str] = set()  # local names bound to product modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_product(alias.name):
                    if any(_private(part) for part in alias.name.split(".")):
                        yield node.lineno, f"import {alias.name}"
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_product(node.module)
        ):
            if any(_private(part) for part in node.module.split(".")):
                yield node.lineno, f"from {node.module} import ..."
            for alias in node.names:
                if _private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"
                bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _root(node.value) in bound:
            yield node.lineno, f"{ast.unparse(node)}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and _root(node.args[0]) in bound
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            yield node.lineno, f"{ast.unparse(node)}"


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (`a` of `a.b.c`), or None."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_the_checker_finds_every_form() -> None:
    source = (
        "import learner.trainers.packed_attention as pa\n"
        "import learner.kernels\n"
        "from learner.trainers import packed_attention\n"
        "from learner.kernels import _indexed_deepstack, compile_blocks\n"
        "from rollout_server._impl import thing\n"
        "from bench_learner import _device_name\n"  # a bench helper, not the product
        "import torch\n"
        "pa._register()\n"
        "packed_attention._segment_loop(1)\n"
        "learner.kernels._x.y\n"
        "compile_blocks.__name__\n"
        "getattr(pa, '_varlen_call')\n"
        "torch._dynamo.reset()\n"
        "pa.public_name\n"
    )
    assert [what for _, what in sorted(private_uses(source))] == [
        "from learner.kernels import _indexed_deepstack",
        "from rollout_server._impl import ...",
        "pa._register",
        "packed_attention._segment_loop",
        "learner.kernels._x",
        "getattr(pa, '_varlen_call')",
    ]


@pytest.mark.parametrize("directory", SCANNED)
def test_benches_and_scripts_touch_no_private_product_name(directory: str) -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in sorted((REPO / directory).rglob("*.py"))
        for line, what in sorted(set(private_uses(path.read_text(encoding="utf-8"))))
    ]
    assert not offenders, (
        f"{directory}/ uses private names of the product ({', '.join(PRODUCT)}); give the product a public "
        "name for what it needs and call that:\n" + "\n".join(offenders)
    )

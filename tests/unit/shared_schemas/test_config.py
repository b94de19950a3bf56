"""The shared configuration layer (`shared_schemas/config.py`, `shared_schemas/server_config.py`): light to
import, one loader for both processes (`extends:`, `~`, provenance), one GPU-list rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared_schemas.config import (
    REPO_ROOT,
    ConfigError,
    GpuList,
    is_loopback,
    load_yaml_tree,
    load_yaml_with_extends,
    parse_gpu_list,
)

_HEAVY = ["torch", "vllm", "fastapi", "starlette", "transformers"]


@pytest.mark.parametrize(
    ("modules", "forbidden"),
    [
        ("shared_schemas.config, shared_schemas.server_config", [*_HEAVY, "rollout_server", "learner"]),
        ("learner.yaml_loader, learner.grpo.config, learner.grpo.resolve", ["rollout_server"]),
    ],
    ids=["shared-config-is-light", "learner-config-path-imports-no-server"],
)
def test_config_layer_imports(modules: str, forbidden: list[str]) -> None:
    """In a fresh interpreter: the shared layer loads no heavy or process package, and the learner's config
    path (loader, GRPO validation, resolver) no `rollout_server` module."""
    code = (
        f"import json, sys\nimport {modules}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {set(forbidden)!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_home_is_expanded_in_the_path_and_in_extends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "base.yaml").write_text("a: {x: 1}\n", encoding="utf-8")
    (tmp_path / "run.yaml").write_text("extends: ~/base.yaml\na: {y: 2}\n", encoding="utf-8")
    tree, prov = load_yaml_tree("~/run.yaml")
    assert tree == {"a": {"x": 1, "y": 2}} == load_yaml_with_extends("~/run.yaml")
    assert prov[("a", "x")] == tmp_path / "base.yaml" and prov[("a", "y")] == tmp_path / "run.yaml"


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml does not exist"):
        load_yaml_tree(tmp_path / "nope.yaml")


def test_gpu_list_forms() -> None:
    from pydantic import TypeAdapter

    gpus = TypeAdapter(GpuList)
    assert gpus.validate_python("0, 2") == (0, 2) and gpus.validate_python(3) == (3,)
    assert (
        gpus.validate_python("") is None
        and gpus.validate_python([]) is None
        and gpus.validate_python(None) is None
    )
    assert parse_gpu_list("") == ()
    with pytest.raises(ValueError, match="comma-separated"):
        gpus.validate_python("a,b")


def test_loopback_names_and_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.5", "trainer-node-3"))


def test_exponent_floats_without_a_dot_are_floats(tmp_path: Path) -> None:
    # YAML 1.1 (PyYAML's default) reads `3e-4` as a string, which reached AdamW as lr='3e-4' and failed
    # with a TypeError deep in torch; the loader follows YAML 1.2's float rule instead.
    (tmp_path / "run.yaml").write_text(
        "lr: 3e-4\nbig: 1E5\ndotted: 3.0e-4\nint: 30\nversion: '1e3'\nword: e5\nip: 1.2.3\n", encoding="utf-8"
    )
    tree = load_yaml_with_extends(tmp_path / "run.yaml")
    assert tree == {
        "lr": 3e-4,
        "big": 1e5,
        "dotted": 3e-4,
        "int": 30,
        "version": "1e3",
        "word": "e5",
        "ip": "1.2.3",
    }
    assert isinstance(tree["lr"], float) and isinstance(tree["int"], int)

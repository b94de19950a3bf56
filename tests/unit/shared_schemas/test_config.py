"""The shared configuration layer (`shared_schemas/config.py`, `shared_schemas/server_config.py`): light to
import, one loader for both processes (`extends:`, `~`, provenance), one GPU-list rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field, ValidationError, model_validator

from shared_schemas.config import (
    REPO_ROOT,
    ConfigError,
    ConfigSection,
    GpuList,
    format_validation_error,
    is_loopback,
    load_yaml_tree,
    load_yaml_with_extends,
    parse_gpu_list,
    rule_error,
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


class _Inner(ConfigSection):
    port: int = Field(default=1, ge=1)


class _Section(ConfigSection):
    name: str
    inner: _Inner = Field(default_factory=_Inner)

    @model_validator(mode="after")
    def _check(self) -> _Section:
        if self.name == "rule":
            raise rule_error("inner.port", "a rule's reason; the fix")
        if self.name == "plain":
            raise ValueError("sec.name 'plain' is refused; pick another")
        return self


def _message(data: dict[str, Any], **kwargs: Any) -> str:
    with pytest.raises(ValidationError) as info:
        _Section.model_validate(data)
    return format_validation_error(info.value, "run.yaml", **kwargs)


def test_one_formatter_names_file_key_and_problem_never_the_value() -> None:
    assert _message({"name": "x", "bogus": 1}, prefix=("sec",)) == (
        "run.yaml: sec.bogus: unknown key; remove it or fix its spelling (docs/RUNBOOK.md lists every key)"
    )
    assert _message({}) == "run.yaml: name: required key is missing"
    assert _message({"name": "rule"}) == "run.yaml: inner.port: a rule's reason; the fix"
    assert _message({"name": "plain"}) == "run.yaml: sec.name 'plain' is refused; pick another"
    parent = Path("/cfg/parent.yaml")
    message = _message(
        {"name": "x", "inner": {"port": -7}}, prefix=("sec",), provenance={("sec", "inner"): parent}
    )
    assert (
        message == f"{parent}: sec.inner.port: Input should be greater than or equal to 1"
        and "-7" not in message
    )


def test_the_formatter_names_ten_errors_and_counts_the_rest() -> None:
    message = _message({"name": "x", **{f"k{i}": i for i in range(12)}})
    assert message.count("unknown key") == 10 and message.endswith(" (+2 more)")


def test_both_processes_word_the_same_mistake_alike(tmp_path: Path) -> None:
    """The learner's run config and the server's section report an unknown key through the one formatter."""
    from learner.config import load_run_config
    from shared_schemas.server_config import load_server_config

    path = tmp_path / "run.yaml"
    path.write_text("model: {path: /m, bogus: 1}\ndata: {train: []}\nserver: {model: /m, bogus: 1}\n")
    messages = []
    for load in (load_run_config, load_server_config):
        with pytest.raises(ConfigError) as info:
            load(path)
        messages.append(str(info.value).split(".bogus: ", 1))
    assert messages[0][1] == messages[1][1] and messages[0][0] == f"{path}: model"

"""`extends:` in run YAMLs (learner/yaml_loader.py): relative parents resolve against the file that names
them, absolute ones are used as they are; parents merge first, mappings deeply, lists replace; cycles are
errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.yaml_loader import ConfigError, load_yaml_with_extends


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_relative_parent_resolves_against_the_naming_file(tmp_path: Path, monkeypatch) -> None:
    write(tmp_path / "configs" / "base.yaml", "a: {x: 1, y: [1, 2]}\nb: base\n")
    child = write(tmp_path / "configs" / "child.yaml", "extends: base.yaml\na: {y: [3]}\n")
    monkeypatch.chdir(tmp_path)  # not the file's directory
    assert load_yaml_with_extends(child) == {"a": {"x": 1, "y": [3]}, "b": "base"}


def test_absolute_parent_is_used_as_is(tmp_path: Path) -> None:
    base = write(tmp_path / "repo" / "configs" / "base.yaml", "a: {x: 1}\nb: base\n")
    variant = write(tmp_path / "elsewhere" / "variant.yaml", f"extends: {base}\na: {{z: 2}}\n")
    run = write(tmp_path / "runs" / "run.yaml", f'extends: "{variant}"\nb: run\n')
    assert load_yaml_with_extends(run) == {"a": {"x": 1, "z": 2}, "b": "run"}


def test_parent_list_merges_in_order_and_cycles_fail(tmp_path: Path) -> None:
    write(tmp_path / "p1.yaml", "k: 1\nm: {a: 1}\n")
    write(tmp_path / "p2.yaml", "k: 2\nm: {b: 2}\n")
    child = write(tmp_path / "c.yaml", "extends: [p1.yaml, p2.yaml]\n")
    assert load_yaml_with_extends(child) == {"k": 2, "m": {"a": 1, "b": 2}}
    write(tmp_path / "x.yaml", "extends: y.yaml\n")
    write(tmp_path / "y.yaml", "extends: x.yaml\n")
    with pytest.raises(ConfigError, match="extends cycle"):
        load_yaml_with_extends(tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_yaml_with_extends(write(tmp_path / "z.yaml", "extends: /no/such/parent.yaml\n"))

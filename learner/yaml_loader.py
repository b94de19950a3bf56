"""YAML loading with `extends:` inheritance (docs/ARCHITECTURE.md#configuration), separate from the config
models.

Rules: `extends` is a path or a list of paths relative to the file that names them; parents merge first
(in list order), then the file itself; mappings merge deeply, every other value (lists included) replaces;
a cycle is an error. Validation errors from the pydantic models are turned into `ConfigError` with the
file and the dotted key, so `__main__` can print one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

__all__ = ["ConfigError", "deep_merge", "format_validation_error", "load_yaml_with_extends"]


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the dotted key."""


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Returns `base` updated by `override`: mappings merge recursively, anything else replaces."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_yaml_with_extends(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Loads a YAML mapping and resolves its `extends` chain.

    Args:
        path: the YAML file.

    Returns:
        The merged mapping, without the `extends` key.

    Raises:
        ConfigError: missing file, not a mapping, bad `extends` value, or an inheritance cycle.
    """
    path = Path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"{path}: extends cycle: {cycle}")
    if not path.is_file():
        where = f" (extended by {_chain[-1]})" if _chain else ""
        raise ConfigError(f"config file {path} not found{where}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    parents = data.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: key 'extends' must be a path or a list of paths")
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = deep_merge(merged, load_yaml_with_extends(path.parent / parent, (*_chain, path)))
    return deep_merge(merged, data)


def format_validation_error(exc: ValidationError, source: str | Path, prefix: str = "") -> str:
    """One line naming the file and each failing dotted key (at most 5), without echoing values."""
    parts = []
    for err in exc.errors()[:5]:
        key = ".".join(str(p) for p in err["loc"]) if err["loc"] else "(top level)"
        if prefix:
            key = f"{prefix}.{key}"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling against configs/ and docs/RUNBOOK.md)"
        parts.append(f"{key}: {msg}")
    more = f" (+{len(exc.errors()) - 5} more)" if len(exc.errors()) > 5 else ""
    return f"{source}: " + "; ".join(parts) + more

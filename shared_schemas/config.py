"""The configuration layer both processes share (docs/ARCHITECTURE.md#configuration): the YAML loader with
`extends:`, the section base class, the one formatter of validation errors, the GPU-list type and the loopback
names.

Loading is separate from validation. `extends` is a path or a list of paths relative to the file that names
them (`~` expanded); parents merge first, in list order, then the file itself; mappings merge deeply, every
other value (lists included) replaces; a cycle is an error. The loader never reads environment variables
(only entry points and launchers do). Imports pydantic and PyYAML only.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

__all__ = [
    "CONFIG_RULE",
    "LOOPBACK_HOSTS",
    "REPO_ROOT",
    "ConfigError",
    "ConfigSection",
    "GpuList",
    "Provenance",
    "deep_merge",
    "format_validation_error",
    "is_loopback",
    "load_yaml_tree",
    "load_yaml_with_extends",
    "parse_gpu_list",
    "rule_error",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository root: relative model, data and output paths in a config resolve against it."""

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""Host names that are always loopback (any address in 127.0.0.0/8 or ::1 is too: `is_loopback`)."""


class ConfigError(ValueError):
    """An invalid configuration; the message names the file and/or the dotted key, and the fix."""


CONFIG_RULE = "config_rule"
"""pydantic error type of a rule that names its own key (`rule_error`); `ctx` holds `key` and `reason`."""

MAX_REPORTED_ERRORS = 10
"""Validation errors named in one `ConfigError`; the rest are counted."""


def rule_error(key: str, reason: str) -> PydanticCustomError:
    """A validator's error that names its dotted key, relative to the model raising it (a model validator
    has no location of its own); `reason` says the problem and the fix."""
    return PydanticCustomError(CONFIG_RULE, "{key}: {reason}", {"key": key, "reason": reason})


class ConfigSection(BaseModel):
    """Base of every YAML section model: unknown keys are errors, values are frozen, and each field's
    docstring is its description (the knob tables are generated from it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def is_loopback(host: str) -> bool:
    """True for the names of `LOOPBACK_HOSTS` and any loopback IP address."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_gpu_list(value: Any) -> Any:
    """Accepts `"0,1,2"`, `0` or `[0, 1, 2]` (`""` is the empty list); other shapes go to the type check."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, str):
        try:
            return tuple(int(part) for part in value.split(",") if part.strip() != "")
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a comma-separated list of GPU indices") from exc
    return value


def _gpus_or_none(value: Any) -> Any:
    parsed = parse_gpu_list(value)
    return None if parsed is None or (isinstance(parsed, tuple | list) and not parsed) else parsed


GpuList = Annotated[tuple[Annotated[int, Field(ge=0)], ...] | None, BeforeValidator(_gpus_or_none)]
"""GPU indices for `CUDA_VISIBLE_DEVICES` (`"0,1"`, `[0, 1]` or `0`); None (also `""`, `[]`): not set."""


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Returns `base` updated by `override`: mappings merge recursively, all else (lists too) replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


Provenance = dict[tuple[str, ...], Path]
"""Dotted key (as a tuple) → the file that set it last."""


def _record(tree: Mapping[str, Any], path: Path, prefix: tuple[str, ...], prov: Provenance) -> None:
    for key, value in tree.items():
        dotted = (*prefix, str(key))
        prov[dotted] = path
        if isinstance(value, Mapping):
            _record(value, path, dotted, prov)


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's float rule: ``3e-4`` and ``1E5`` are floats, as users write
    learning rates (YAML 1.1, PyYAML's default, needs ``3.0e-4`` and reads ``3e-4`` as a string)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml_tree(path: str | Path, _chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], Provenance]:
    """Reads a YAML file with its `extends:` chain (parents first, relative to the file naming them).

    Args:
        path: the YAML file (`~` is expanded).

    Returns:
        The merged mapping (without `extends`) and, for every dotted key, the file that set it last.

    Raises:
        ConfigError: missing file, invalid YAML, a non-mapping document, a bad `extends` value or a cycle.
    """
    path = Path(path).expanduser().resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"{path}: extends cycle: {cycle}; remove one of the extends entries")
    if not path.is_file():
        where = f" (extended by {_chain[-1]})" if _chain else ""
        raise ConfigError(
            f"config file {path} does not exist{where}; pass an existing --config (or fix the extends entry"
            " that names a file not found)"
        )
    try:
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(doc).__name__}")
    parents = doc.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: key 'extends' must be a path or a list of paths")
    merged: dict[str, Any] = {}
    prov: Provenance = {}
    for parent in parents:
        tree, parent_prov = load_yaml_tree(path.parent / Path(parent).expanduser(), (*_chain, path))
        merged = deep_merge(merged, tree)
        prov.update(parent_prov)
    _record(doc, path, (), prov)
    return deep_merge(merged, doc), prov


def load_yaml_with_extends(path: str | Path) -> dict[str, Any]:
    """`load_yaml_tree` without the provenance: the merged mapping, without the `extends` key.

    Raises:
        ConfigError: as `load_yaml_tree`.
    """
    return load_yaml_tree(path)[0]


def format_validation_error(
    exc: ValidationError,
    source: str | Path,
    *,
    prefix: tuple[str, ...] = (),
    provenance: Provenance | None = None,
) -> str:
    """The one line of a `ConfigError` for a config model's `ValidationError`, in both processes.

    Each failing key (the first `MAX_REPORTED_ERRORS`) is named as `file: dotted.key: problem`, never with
    its value; the file is the one that set the key (or its nearest parent key) per `provenance`, else
    `source`.

    Args:
        exc: the error of validating one section (or a whole run).
        source: the file (or `<mapping>`) named when `provenance` does not know the key.
        prefix: the dotted key of the validated section in its file (`("server",)`), empty for a whole run.
        provenance: dotted key → the file that set it (`load_yaml_tree`).
    """
    prov = provenance or {}
    errors = exc.errors()
    parts = []
    for err in errors[:MAX_REPORTED_ERRORS]:
        loc = tuple(str(part) for part in err["loc"])
        if err["type"] == CONFIG_RULE:
            loc = (*loc, err["ctx"]["key"])
        key = (*prefix, *loc)
        where = next((prov[key[:n]] for n in range(len(key), 0, -1) if key[:n] in prov), source)
        if err["type"] == "extra_forbidden":
            msg = "unknown key; remove it or fix its spelling (docs/RUNBOOK.md lists every key)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] == CONFIG_RULE:
            msg = err["ctx"]["reason"]
        else:  # a validator's ValueError names its keys itself; pydantic prefixes "Value error, "
            msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {'.'.join(key)}: {msg}" if key else f"{where}: {msg}")
    more = len(errors) - MAX_REPORTED_ERRORS
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")

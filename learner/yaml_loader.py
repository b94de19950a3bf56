"""YAML loading for the learner (docs/ARCHITECTURE.md#configuration), separate from the config models.

The loader (`extends:` chains, `~`, deep merge, lists replace, cycles are errors), `ConfigError` and
`deep_merge` are the ones the rollout server uses, defined once in `shared_schemas.config`; this module adds
only the learner's one-line form of a pydantic `ValidationError`, so `__main__` can print one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from shared_schemas.config import ConfigError, deep_merge, load_yaml_with_extends

__all__ = ["ConfigError", "deep_merge", "format_validation_error", "load_yaml_with_extends"]


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

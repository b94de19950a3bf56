"""Shared inputs of the GRPO config tests: the shipped presets and a model-path patch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared_schemas.config import REPO_ROOT

__all__ = ["ATTR_KEY_PRESET", "REPO_ROOT", "SERVER_PRESET", "with_model"]

SERVER_PRESET = REPO_ROOT / "configs" / "grpo_summary_1024_server.yaml"
ATTR_KEY_PRESET = REPO_ROOT / "configs" / "grpo_summary_1024_attr_key_recall_server.yaml"


def with_model(raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """Points the placeholder model paths of a preset at ``model_dir`` (rule 10 needs an existing dir)."""
    raw["model"]["path"] = str(model_dir)
    raw["server"]["model"] = str(model_dir)
    return raw

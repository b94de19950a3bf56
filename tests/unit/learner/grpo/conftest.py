"""Fixtures of the GRPO config tests: the shipped server preset with its model paths pointed at a temp dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from learner.yaml_loader import load_yaml_with_extends

REPO_ROOT = Path(__file__).resolve().parents[4]
SERVER_PRESET = REPO_ROOT / "configs" / "grpo_summary_1024_server.yaml"
ATTR_KEY_PRESET = REPO_ROOT / "configs" / "grpo_summary_1024_attr_key_recall_server.yaml"


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    return path


def with_model(raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    raw["model"]["path"] = str(model_dir)
    raw["server"]["model"] = str(model_dir)
    return raw


@pytest.fixture()
def server_raw(model_dir: Path) -> dict[str, Any]:
    """The default preset (configs/grpo_summary_1024_server.yaml), model path replaced."""
    return with_model(load_yaml_with_extends(SERVER_PRESET), model_dir)

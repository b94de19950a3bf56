"""Fixtures of the GRPO config tests: the shipped server preset with its model paths pointed at a temp dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from learner.yaml_loader import load_yaml_with_extends
from tests.unit.learner.grpo.grpo_examples import SERVER_PRESET, with_model


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    return path


@pytest.fixture()
def server_raw(model_dir: Path) -> dict[str, Any]:
    """The default preset (configs/grpo_summary_1024_server.yaml), model path replaced."""
    return with_model(load_yaml_with_extends(SERVER_PRESET), model_dir)

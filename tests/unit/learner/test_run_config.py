"""Cross-section rules of the run config that HF would otherwise report late (after the model loads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.config import load_run_config
from learner.yaml_loader import ConfigError

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo_tiny_cpu.yaml"


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_evaluation_without_eval_data_is_a_config_error(strategy: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_run_config(DEMO, {"data": {"eval": []}, "training": {"eval_strategy": strategy}})
    message = str(exc.value)
    assert "training.eval_strategy" in message and "data.eval" in message and "\n" not in message


def test_no_evaluation_needs_no_eval_data() -> None:
    cfg = load_run_config(DEMO, {"data": {"eval": []}, "training": {"eval_strategy": "no"}})
    assert cfg.data.eval == []

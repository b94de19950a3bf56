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


def test_async_rollouts_in_colocate_mode_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as exc:
        load_run_config(DEMO, {"rollout": {"mode": "colocate", "async": {"enabled": True}}})
    message = str(exc.value)
    assert "rollout.async.enabled" in message and "rollout.mode" in message and "\n" not in message


def test_async_rollouts_keys_are_validated_by_name() -> None:
    with pytest.raises(ConfigError) as exc:
        load_run_config(DEMO, {"rollout": {"async": {"enabled": True, "max_staleness": 0}}})
    assert "rollout.async.max_staleness" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_run_config(DEMO, {"rollout": {"async": {"enabeld": True}}})
    assert "rollout.async.enabeld" in str(exc.value)
    cfg = load_run_config(DEMO, {"rollout": {"async": {"enabled": True, "max_staleness": 2}}})
    assert cfg.rollout.async_.enabled and cfg.rollout.async_.max_staleness == 2
    assert cfg.rollout.async_wait_timeout_s == 4 * cfg.rollout.read_timeout_s
    assert cfg.model_dump(mode="json")["rollout"]["async"]["enabled"] is True


def test_repeat_terminate_bounds_are_the_wire_contracts() -> None:
    """One definition of the guard's knobs (issue 26): `max_object_keys: 0`, which the server refuses, fails
    when the config loads, naming the key."""
    import pytest
    from pydantic import ValidationError

    from learner.config import DecodingConfig

    with pytest.raises(ValidationError, match="max_object_keys"):
        DecodingConfig.model_validate({"repeat_terminate": {"enabled": True, "max_object_keys": 0}})
    with pytest.raises(ValidationError, match="bogus"):
        DecodingConfig.model_validate({"repeat_terminate": {"bogus": 1}})

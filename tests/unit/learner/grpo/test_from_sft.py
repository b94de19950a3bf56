"""`learner.grpo.config.grpo_config_from_sft`: a repo SFT config becomes a GRPO run its loader accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from learner.grpo.config import ConfigError, grpo_config_from_sft
from learner.grpo.main import resolve_grpo_config
from learner.yaml_loader import load_yaml_with_extends
from tests.unit.learner.grpo.grpo_examples import REPO_ROOT


@pytest.mark.parametrize("config", ["demo_tiny_cpu.yaml", "demo_vlm_cpu.yaml"])
def test_sft_demo_config_becomes_a_valid_grpo_run(config: str, tmp_path: Path) -> None:
    sft = load_yaml_with_extends(REPO_ROOT / "configs" / config)
    (tmp_path / "base").mkdir()
    cfg = grpo_config_from_sft(sft, model=str(tmp_path / "base"), grpo={"reward_preset": "detection"})
    cfg["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))

    resolved, run = resolve_grpo_config(path)

    assert "server" not in cfg and cfg["rollout"]["mode"] == "colocate"
    assert resolved.grpo.reward_preset == "detection" and resolved.grpo.num_generations == 4
    decoding = sft["rollout"]["decoding"]
    assert resolved.grpo.max_completion_length == decoding["max_new_tokens"]
    assert resolved.grpo.temperature == 1.0
    samples = sft["training"]["per_device_train_batch_size"] * sft["training"].get(
        "gradient_accumulation_steps", 1
    )
    assert cfg["rollout"]["decoding"]["rollout_generate_batch_size"] == samples
    assert run.training["learning_rate"] == sft["training"]["learning_rate"]
    assert run.training["lr_scheduler_type"] == "constant" and run.training["warmup_steps"] == 0


def test_samples_per_step_not_a_multiple_of_the_group_is_refused() -> None:
    sft = load_yaml_with_extends(REPO_ROOT / "configs" / "demo_tiny_cpu.yaml")
    sft["training"] |= {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 1}
    with pytest.raises(ConfigError, match="not a multiple of grpo.num_generations 4"):
        grpo_config_from_sft(sft, model="m", num_generations=4)

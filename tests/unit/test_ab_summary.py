"""bench/ab_learning.py's summary: paired differences over the seeds both arms finished, with a t interval."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ab_learning  # noqa: E402


def _curve(f1: float) -> list[dict[str, float]]:
    return [{"step": 0, "f1": 0.5, "pred": 10.0}, {"step": 20, "f1": f1, "pred": 10.0}]


def test_paired_difference_uses_only_seeds_with_an_sft_run_and_carries_a_t_interval() -> None:
    curves = {("sft", 0): _curve(0.30), ("sft", 1): _curve(0.32), ("sft", 2): _curve(0.34)}
    curves |= {("grpo", 0): _curve(0.60), ("grpo", 1): _curve(0.64), ("grpo", 2): _curve(0.65)}
    curves[("grpo", 3)] = _curve(0.99)  # its sft run was cut off: reported, not paired
    line = {x["arm"]: x for x in ab_learning.summarize("t", curves)}["grpo"]
    assert line["seeds"] == [0, 1, 2, 3] and line["paired_seeds"] == [0, 1, 2]
    assert line["paired_diff"] == pytest.approx([0.30, 0.32, 0.31])
    half = 4.302652729911275 * 0.01 / 3**0.5  # t(0.975, 2 dof) x sd / sqrt(n)
    assert line["paired_ci95"] == pytest.approx([0.31 - half, 0.31 + half])


def test_one_paired_seed_has_no_interval() -> None:
    curves = {("sft", 0): _curve(0.3), ("rm-reorder", 0): _curve(0.4)}
    line = {x["arm"]: x for x in ab_learning.summarize("t", curves)}["rm-reorder"]
    assert line["paired_mean"] == pytest.approx(0.1) and "paired_ci95" not in line


@pytest.mark.parametrize("arm", sorted(ab_learning.GRPO_ARMS))
def test_every_grpo_arm_gives_a_valid_run_config_with_its_learning_rate(arm: str, tmp_path: Path) -> None:
    import yaml

    from learner.grpo.main import resolve_grpo_config

    task = ab_learning.TASKS["crowded-sorted"]
    (tmp_path / "base").mkdir()
    cfg = ab_learning.grpo_run_config(
        ab_learning.REPO / task["config"],
        {},
        grpo=ab_learning.grpo_override(arm),
        model=str(tmp_path / "base"),
        run_dir=tmp_path / "run",
        seed=3,
        steps=20,
        eval_every=10,
        learning_rate=ab_learning.GRPO_ARMS[arm].get("learning_rate", 1e-4),
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    resolved, run = resolve_grpo_config(path)
    assert run.training["learning_rate"] == ab_learning.GRPO_ARMS[arm].get("learning_rate", 1e-4)
    assert resolved.grpo.reward_preset == ab_learning.GRPO_ARMS[arm]["reward_preset"]

"""bench/ab_learning.py on one seconds grid: runs read by linear interpolation between their evaluations'
seconds (never past their last one), and the strong control's steps sized from the arms' seconds."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _ab import canonical_budget, seconds_grid, summary, tables  # noqa: E402

CANONICAL = tables.CANONICAL


def _curve(points: list[tuple[float, float]], step: int = 3) -> list[dict[str, float]]:
    """Evaluations every ``step`` steps at the given (seconds, F1)."""
    return [{"step": step * i, "seconds": t, "f1": f1, "pred": 9.0} for i, (t, f1) in enumerate(points)]


def test_a_run_is_interpolated_between_its_evaluations_and_never_read_past_its_last() -> None:
    curve = _curve([(0.0, 0.5), (15.0, 0.62), (30.0, 0.68)])
    assert seconds_grid.at_seconds(curve, "f1", 0.0) == 0.5
    assert seconds_grid.at_seconds(curve, "f1", 7.5) == pytest.approx(0.56)
    assert seconds_grid.at_seconds(curve, "f1", 15.0) == 0.62
    assert seconds_grid.at_seconds(curve, "f1", 25.0) == pytest.approx(0.66)
    assert seconds_grid.at_seconds(curve, "f1", 30.0) == 0.68
    assert seconds_grid.at_seconds(curve, "f1", 30.5) is None  # not reached: missing, not 0.68
    assert seconds_grid.at_seconds(curve, "precision", 7.5) is None  # a figure the run did not log


def test_evaluations_far_apart_are_paired_by_interpolation_and_a_short_control_is_missing() -> None:
    """Evaluations 13-18 s apart: the arm ends at 31 s, the control at 26 s. Read "at the last evaluation
    inside the budget" the arm would be its base at 13 s (a -0.064 artifact); on the grid the headline at
    31 s is missing (the control never got there) and the fractions are interpolated."""
    arm = _curve([(0.0, 0.500), (18.0, 0.610), (31.0, 0.650)])
    control = _curve([(0.0, 0.500), (13.0, 0.564), (26.0, 0.600)])
    assert seconds_grid.paired_at_seconds(arm, control, "f1", 31.0) is None
    assert seconds_grid.paired_at_seconds(arm, control, "f1", 13.0) == pytest.approx(
        (0.5 + 0.11 * 13 / 18) - 0.564
    )
    curves = {("rm-reorder", 0): arm, (CANONICAL, 0): control}
    units = {key: "gpu" for key in curves}
    lines = {x["arm"]: x for x in summary.summarize("t", curves, units=units)}
    line = lines["rm-reorder"]
    assert line["canonical_paired_at_seconds"] == [31.0]
    assert (
        line["canonical_paired_at_seconds_missing"] == [0] and line["canonical_paired_at_seconds_seeds"] == []
    )
    assert "canonical_paired_at_seconds_f1" not in line  # no pair taken from an earlier evaluation
    half = line["canonical_paired_at_fractions_f1"]["0.5"]  # 15.5 s: arm 0.5 + 0.11 x 15.5/18, control 0.5 +
    assert half["mean"] == pytest.approx((0.5 + 0.11 * 15.5 / 18) - (0.564 + 0.036 * 2.5 / 13))
    assert lines[CANONICAL]["canonical_seconds_short"][0]["arm_seconds"] == 31.0


def test_paired_figures_over_seeds_carry_a_t_interval() -> None:
    curves = {}
    for seed, (arm_f1, control_f1) in enumerate([(0.66, 0.60), (0.64, 0.61), (0.70, 0.62)]):
        curves[("rm-reorder", seed)] = _curve([(0.0, 0.5), (20.0, arm_f1)])
        curves[(CANONICAL, seed)] = _curve(
            [(0.0, 0.5), (10.0, 0.55), (20.0, control_f1), (25.0, 0.7)], step=2
        )
    units = {key: "cpu" for key in curves}
    line = {x["arm"]: x for x in summary.summarize("t", curves, units=units)}["rm-reorder"]
    f1 = line["canonical_paired_at_seconds_f1"]
    assert (
        f1["diff"] == pytest.approx([0.06, 0.03, 0.08]) and line["canonical_paired_at_seconds_missing"] == []
    )
    half = 4.302652729911275 * f1["sd"] / math.sqrt(3)  # Student's t(0.975, 2 dof)
    assert f1["ci95"] == pytest.approx([f1["mean"] - half, f1["mean"] + half])


def test_the_control_gets_the_slowest_arms_seconds_at_the_sft_runs_seconds_per_step() -> None:
    budget = canonical_budget.size_canonical({"rm-reorder": 101.0, "rm-drop": 80.0}, 40.0, 20, 20, "gpu")
    assert budget["steps"] == 51 and budget["arm"] == "rm-reorder"  # ceil(101 / 2.0)
    assert budget["sft_step_seconds"] == 2.0 and budget["unit"] == "gpu"
    assert canonical_budget.size_canonical({"a": 100.0}, 40.0, 20, 20)["steps"] == 50  # exact: no extra step
    assert canonical_budget.size_canonical({}, 40.0, 20, 20)["steps"] == 20  # nothing to match: --steps
    assert canonical_budget.size_canonical({"a": 100.0}, None, 20, 20)["reason"].startswith("no timed sft")


def test_the_seeds_runs_size_it_unless_canonical_steps_is_fixed() -> None:
    curves = {
        ("sft", 0): _curve([(0.0, 0.5), (12.0, 0.6)]),
        ("rm-reorder", 0): _curve([(0.0, 0.5), (30.0, 0.6)]),
        ("rm-drop", 0): _curve([(0.0, 0.5), (50.0, 0.6)]),  # another unit: not priced by sft's seconds
        ("rm-reorder", 1): _curve([(0.0, 0.5), (99.0, 0.6)]),  # another seed
    }
    units = {key: "cpu" for key in curves} | {("rm-drop", 0): "gpu"}
    budget = canonical_budget.budget_for_seed(curves, units, 0, 6, None)
    assert (budget["steps"], budget["arm"]) == (15, "rm-reorder")  # 30 s at 12 s / 6 steps
    assert canonical_budget.budget_for_seed(curves, units, 0, 6, 40) == {
        "steps": 40,
        "reason": "--canonical-steps",
    }


def test_the_sized_control_is_configured_for_exactly_its_steps(tmp_path: Path) -> None:
    """Its learning-rate schedule ends at its own last step: the run's `max_steps` is the base plus the sized
    steps (the resumed trainer builds its schedule from `max_steps`), not a longer run read mid-way."""
    from _ab import run_configs

    common = {"extends": str(tables.REPO / tables.TASKS["text-random"]["config"]), "training": {}}
    steps = canonical_budget.size_canonical({"rm-reorder": 31.0}, 12.0, 6, 6)["steps"]
    cfg = run_configs.canonical_run_config(
        common, {}, model=str(tmp_path / "checkpoint-6"), ordering="sorted", run_dir=tmp_path / "c", seed=0,
        steps=steps, eval_every=3, learning_rate=None, base_steps=6,
    )  # fmt: skip
    assert steps == 16 and cfg["training"]["max_steps"] == 6 + 16


def test_the_common_grid_spans_the_longest_run() -> None:
    grid = seconds_grid.common_grid([_curve([(0.0, 0.5), (10.0, 0.6)]), _curve([(0.0, 0.5), (40.0, 0.6)])], 5)
    assert grid == [0.0, 10.0, 20.0, 30.0, 40.0]

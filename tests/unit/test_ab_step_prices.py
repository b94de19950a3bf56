"""bench/ab_learning.py's runs side by side on one GPU: ``--price-seed`` reads them at the seconds their arm's
step cost alone (the pricing seed's runs), the control is sized on those seconds (and run again when short),
a run that lost vLLM's start race starts again, and bad input names the fix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ab_learning  # noqa: E402
from _ab import canonical_budget, run_folder, step_prices, tables  # noqa: E402

CANONICAL = tables.CANONICAL


def _run(out: Path, name: str, step_wall: list[float], gpus: int = 1) -> None:
    """A finished run folder: an evaluation at step 0, one training line per step at ``step_wall`` seconds,
    an evaluation after the last step (evaluations take 5 s each: they must not count)."""
    run = out / name
    run.mkdir(parents=True)
    rows = [{"step": 0, "wall_s": 1.0, "eval_rollout_f1": 0.4, "eval_rollout_pred_objects": 9.0}]
    shift = 1.0  # the first evaluation's line: each training line's wall_s is logged after its step
    rows += [{"step": i + 1, "wall_s": shift + t, "loss": 1.0} for i, t in enumerate(step_wall)]
    last = len(step_wall)
    rows.append(
        {
            "step": last,
            "wall_s": shift + step_wall[-1] + 5.0,
            "eval_rollout_f1": 0.5,
            "eval_rollout_pred_objects": 9.0,
        }
    )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / run_folder.DEVICE_STAMP).write_text(json.dumps({"gpus": gpus}))


def test_each_arm_is_priced_at_its_own_step_and_the_control_at_sfts(tmp_path: Path) -> None:
    _run(tmp_path, "sft-s0-4", [0.25, 0.5, 0.75, 1.0])  # 0.25 s a step, measured alone
    _run(tmp_path, "rm-reorder-s0-4", [1.5, 3.0, 4.5, 6.0])  # 1.5 s a step
    prices = step_prices.arm_prices(tmp_path, 0, 4, ["sft", "rm-reorder", CANONICAL])
    assert prices["unit"] == "gpu" and prices["seed"] == 0
    assert prices["seconds_per_step"] == pytest.approx({"sft": 0.25, "rm-reorder": 1.5, CANONICAL: 0.25})
    step_prices.write_prices(tmp_path, prices)
    assert step_prices.read_prices(tmp_path) == prices
    # a control launched on its own reads every arm's price from the stamp
    assert step_prices.stamped_prices(tmp_path, 0, [CANONICAL]) == prices
    with pytest.raises(SystemExit, match=r"arms \['rm-keep'\] were not run on seed 0"):
        step_prices.stamped_prices(tmp_path, 0, ["rm-keep"])
    with pytest.raises(SystemExit, match="holds no prices from seed 1"):
        step_prices.stamped_prices(tmp_path, 1, ["sft"])


def test_a_control_is_priced_at_the_sft_step_when_the_pricing_run_left_it_out(tmp_path: Path) -> None:
    """The pricing seed's arms ran without the control (it was launched later, beside the other seeds): the
    control's step is still the sft step, so a control launched on its own is sized; without an sft price
    it is not."""
    _run(tmp_path, "sft-s0-4", [0.25, 0.5, 0.75, 1.0])
    _run(tmp_path, "rm-reorder-s0-4", [1.5, 3.0, 4.5, 6.0])
    step_prices.write_prices(tmp_path, step_prices.arm_prices(tmp_path, 0, 4, ["sft", "rm-reorder"]))
    prices = step_prices.stamped_prices(tmp_path, 0, ["sft", CANONICAL])
    assert step_prices.priced_budget(prices, 4)["steps"] == 24  # 4 reorder steps x 1.5 s / 0.25 s
    step_prices.write_prices(tmp_path, step_prices.arm_prices(tmp_path, 0, 4, ["rm-reorder"]))
    with pytest.raises(SystemExit, match=r"arms \['sft-canonical'\] were not run on seed 0"):
        step_prices.stamped_prices(tmp_path, 0, [CANONICAL])


def test_a_run_beside_others_is_read_at_its_price_and_its_wall_is_kept() -> None:
    # a reorder run that took 3 x its price beside seven others: 4 steps at 1.5 s are 6 priced seconds
    curve = [{"step": 150, "f1": 0.4, "seconds": 0.0}, {"step": 152, "f1": 0.45, "seconds": 9.0}]
    curve.append({"step": 154, "f1": 0.5, "seconds": 18.0})
    got = step_prices.priced(curve, 1.5)
    assert [p["seconds"] for p in got] == [0.0, 3.0, 6.0]
    assert [p["wall_seconds"] for p in got] == [0.0, 9.0, 18.0]
    assert step_prices.contention(got) == pytest.approx(3.0)


def test_the_control_is_sized_on_priced_seconds() -> None:
    """Priced seconds size `sft-canonical` at arm steps x (arm price ÷ sft price), whatever the wall was."""
    sft = step_prices.priced(
        [{"step": 0, "f1": 0.4, "seconds": 0}, {"step": 40, "f1": 0.5, "seconds": 99}], 0.25
    )
    arm = step_prices.priced(
        [{"step": 0, "f1": 0.4, "seconds": 0}, {"step": 40, "f1": 0.6, "seconds": 500}], 1.5
    )
    curves = {("sft", 3): sft, ("rm-reorder", 3): arm}
    units = {("sft", 3): "gpu", ("rm-reorder", 3): "gpu"}
    budget = canonical_budget.budget_for_seed(curves, units, 3, 40, None)
    assert budget["steps"] == 240 and budget["arm"] == "rm-reorder"
    # the same budget from the prices alone: a control launched beside its seed's arms
    prices = {
        "unit": "gpu",
        "seconds_per_step": {"sft": 0.25, "rm-reorder": 1.5, "grpo-x": 1.0, CANONICAL: 0.25},
    }
    assert step_prices.priced_budget(prices, 40) == {**budget, "arm_seconds": 60.0, "sft_step_seconds": 0.25}


def test_a_missing_pricing_run_names_the_folder_and_the_fix(tmp_path: Path) -> None:
    _run(tmp_path, "sft-s0-4", [0.25, 0.5, 0.75, 1.0])
    with pytest.raises(SystemExit, match=r"rm-reorder-s0-4 holds no finished run.*--seeds 0"):
        step_prices.arm_prices(tmp_path, 0, 4, ["sft", "rm-reorder"])
    with pytest.raises(SystemExit, match="add the sft arm"):
        step_prices.arm_prices(tmp_path, 0, 4, ["rm-reorder", CANONICAL][1:])


def test_a_memory_share_outside_zero_one_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        ab_learning.main(["--out", "/nonexistent/ab", "--vllm-gpu-memory", "1.5"])
    assert "--vllm-gpu-memory 1.5 must be in (0, 1)" in capsys.readouterr().err


def test_a_run_differing_only_in_where_the_engine_sat_is_reused(tmp_path: Path) -> None:
    """The pricing seed runs with the one-GPU split, the others side by side with a small memory share and
    no sleep: the summary over all seeds must take both as finished, but not a run that decoded otherwise."""
    import yaml

    _run(tmp_path, "rm-reorder-s0-4", [1.5, 3.0, 4.5, 6.0])
    vllm = {"gpu_memory_utilization": 0.35, "sleep_level": 1, "max_model_len": 2048}
    cfg = {"rollout": {"mode": "colocate", "vllm": vllm}, "training": {"max_steps": 4}}
    run = tmp_path / "rm-reorder-s0-4"
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    side = {
        "rollout": {"mode": "colocate", "vllm": {**vllm, "gpu_memory_utilization": 0.06, "sleep_level": 0}}
    }
    assert run_folder.finished(run, {**cfg, **side}, 4)
    other = {"rollout": {"mode": "colocate", "vllm": {**vllm, "max_model_len": 1024}}}
    assert not run_folder.finished(run, {**cfg, **other}, 4)


def test_runs_copied_back_are_read_at_the_pricing_seeds_prices(tmp_path: Path, capsys) -> None:
    """`--from-runs --price-seed 0`: seed 1's runs, 3 x slower beside others, are read at seed 0's prices,
    seed 0's at their own seconds; a run that stopped before its last step is left out and said."""
    _run(tmp_path, "sft-s0-4", [0.25, 0.5, 0.75, 1.0])
    _run(tmp_path, "rm-reorder-s0-4", [1.5, 3.0, 4.5, 6.0])
    _run(tmp_path, "sft-s1-4", [0.75, 1.5, 2.25, 3.0])
    _run(tmp_path, "rm-reorder-s1-4", [4.5, 9.0, 13.5, 18.0])
    _run(tmp_path, "sft-s2-4", [0.25, 0.5])  # stopped after 2 of its 4 steps
    argv = [
        "--task",
        "text-random",
        "--steps",
        "4",
        "--from-runs",
        "--price-seed",
        "0",
        "--out",
        str(tmp_path),
    ]
    assert ab_learning.main(argv) == 0
    assert "sft-s2-4: stopped at step 2 of 4, left out" in capsys.readouterr().out
    lines = [json.loads(x) for x in (tmp_path / "ab.jsonl").read_text().splitlines()]
    final = {(x["arm"], x["seed"]): x["seconds"] for x in lines if not x.get("summary") and x["step"] == 4}
    assert final == pytest.approx(
        {("sft", 0): 1.0, ("rm-reorder", 0): 6.0, ("sft", 1): 1.0, ("rm-reorder", 1): 6.0}
    )
    assert {x["arm"]: x["seeds"] for x in lines if x.get("summary")} == {"sft": [0, 1], "rm-reorder": [0, 1]}


def test_a_run_copied_back_at_its_base_is_left_out_not_read_as_final(tmp_path: Path, capsys) -> None:
    """A supervised arm trains its shared base steps itself: cut off after its base evaluation (step 150 of
    200), its last evaluation is past the arm's own 50 steps but not its last step (``run.yaml``'s
    ``max_steps``), so it is left out rather than read as a run that ended at its base."""
    import yaml

    for name in ("sft-s0-50", "rm-reorder-s0-50", "rm-reorder-s1-50"):
        _run(tmp_path, name, [0.25 * (i + 1) for i in range(200 if name != "rm-reorder-s1-50" else 150)])
        (tmp_path / name / "run.yaml").write_text(yaml.safe_dump({"training": {"max_steps": 200}}))
    argv = ["--task", "image-random", "--steps", "50", "--from-runs", "--out", str(tmp_path)]
    assert ab_learning.main(argv) == 0
    assert "rm-reorder-s1-50: stopped at step 150 of 200, left out" in capsys.readouterr().out
    lines = [json.loads(x) for x in (tmp_path / "ab.jsonl").read_text().splitlines()]
    assert {x["arm"]: x["seeds"] for x in lines if x.get("summary")} == {"sft": [0], "rm-reorder": [0]}


def test_a_control_short_of_the_arms_seconds_is_sized_again_at_its_own_pace() -> None:
    """The GPU run's seed 0: sized 108 steps at the sft run's 0.266 s, the control ran 0.201 s a step and
    trained 21.7 of the arm's 28.5 s; it runs again for ceil(28.5 x 1.05 / 0.201) steps (the margin: a pace
    that drifts again must not leave it short once more), at most twice."""
    first = canonical_budget.size_canonical({"rm-reorder": 28.526}, 30 * 0.26603, 30, 30, "gpu")
    assert first["steps"] == 108
    curve = [{"step": 0, "f1": 0.4, "seconds": 0.0}, {"step": 108, "f1": 0.3, "seconds": 21.716}]
    longer = canonical_budget.top_up(first, curve, 108)
    assert longer is not None and longer["steps"] == 149 and longer["topped_up_from"] == 108
    assert longer["top_up"] == 1 and "top-up 1" in longer["reason"]
    reached = [{"step": 0, "f1": 0.4, "seconds": 0.0}, {"step": 149, "f1": 0.3, "seconds": 28.4}]
    assert canonical_budget.top_up(longer, reached, 149) is None  # within the 2 % tolerance
    again = canonical_budget.top_up({**longer, "top_up": canonical_budget.MAX_TOP_UPS}, curve, 108)
    assert again is None
    assert canonical_budget.top_up({"steps": 50, "reason": "--canonical-steps"}, curve, 50) is None


def test_of_a_control_run_again_the_last_top_up_is_the_control(tmp_path: Path) -> None:
    from _ab.from_runs import canonical_folders

    for steps, budget in ((108, {"steps": 108}), (142, {"steps": 142, "topped_up_from": 108, "top_up": 1})):
        _run(tmp_path, f"{CANONICAL}-s0-{steps}", [0.2 * (i + 1) for i in range(4)])
        canonical_budget.write_budget(tmp_path / f"{CANONICAL}-s0-{steps}", budget)
    assert canonical_folders(tmp_path, None) == [(tmp_path / f"{CANONICAL}-s0-142", 142)]


@pytest.mark.parametrize(
    ("failures", "marker", "runs", "ok"), [(1, True, 2, True), (3, True, 3, False), (1, False, 1, False)]
)
def test_a_run_that_lost_vllms_start_race_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failures: int, marker: bool, runs: int, ok: bool
) -> None:
    """Beside other runs on one GPU, vLLM's start asserts when another process frees memory meanwhile: the
    run (nothing trained yet) starts again, at most twice; any other failure is reported at once."""
    import subprocess

    from _ab import processes

    calls: list[int] = []

    def fake_run(command, stdout, **kwargs):
        calls.append(1)
        failed = len(calls) <= failures
        race = f"AssertionError: {processes.ENGINE_START_RACE}. Initial free memory\n"
        stdout.write((race if marker else "boom\n") if failed else "done\n")
        return subprocess.CompletedProcess(command, 1 if failed else 0)

    monkeypatch.setattr(processes.subprocess, "run", fake_run)
    run = tmp_path / "rm-reorder-s6-30"
    if ok:
        processes.run_learner({"a": 1}, run / "run.yaml", run / "learner.log")
    else:
        with pytest.raises(SystemExit, match="failed with exit code 1"):
            processes.run_learner({"a": 1}, run / "run.yaml", run / "learner.log")
    assert len(calls) == runs


def _resumed_run(out: Path, name: str, base: int, step_wall: list[float]) -> None:
    """A run that resumed the base checkpoint at step ``base``: its start-of-run evaluation (the base) is
    logged at step 0, its training lines at steps ``base + 1`` on."""
    run = out / name
    run.mkdir(parents=True)
    rows = [{"step": 0, "wall_s": 1.0, "eval_rollout_f1": 0.4, "eval_rollout_pred_objects": 9.0}]
    rows += [{"step": base + i + 1, "wall_s": 1.0 + t, "loss": 1.0} for i, t in enumerate(step_wall)]
    last = {"step": base + len(step_wall), "wall_s": 6.0 + step_wall[-1], "eval_rollout_f1": 0.5}
    rows.append({**last, "eval_rollout_pred_objects": 9.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / run_folder.DEVICE_STAMP).write_text(json.dumps({"gpus": 1}))


def _max_steps(run: Path, max_steps: int) -> None:
    import yaml

    (run / "run.yaml").write_text(yaml.safe_dump({"training": {"max_steps": max_steps}}))


def test_an_arm_is_priced_at_its_recipes_steps_not_at_the_base_it_trained(tmp_path: Path) -> None:
    """A supervised arm trains the seed's 4 plain base steps itself (0.25 s each), then 4 rollout steps of
    1.5 s: its price is 1.5 s, not the mean over 8 steps; an arm that resumed the base is priced the same."""
    _run(tmp_path, "sft-s0-4", [0.25 * (i + 1) for i in range(8)])
    _run(
        tmp_path,
        "rm-reorder-s0-4",
        [0.25 * (i + 1) for i in range(4)] + [1.0 + 1.5 * (i + 1) for i in range(4)],
    )
    _resumed_run(tmp_path, "rm-reorder-m4-s0-4", 4, [1.5 * (i + 1) for i in range(4)])
    for name in ("sft-s0-4", "rm-reorder-s0-4", "rm-reorder-m4-s0-4"):
        _max_steps(tmp_path / name, 8)
    prices = step_prices.arm_prices(tmp_path, 0, 4, ["sft", "rm-reorder", "rm-reorder-m4"])
    assert prices["seconds_per_step"] == pytest.approx({"sft": 0.25, "rm-reorder": 1.5, "rm-reorder-m4": 1.5})


def test_runs_from_a_base_are_read_on_one_step_axis_from_the_base(tmp_path: Path) -> None:
    """`--from-runs` with a shared base of 4 steps: the arm that trained it, the arm that resumed it and the
    GRPO run (which counts its own 4 steps) all start at step 4 with 0 s and end at step 8."""
    _run(tmp_path, "sft-s0-4", [0.25 * (i + 1) for i in range(8)])
    _resumed_run(tmp_path, "rm-reorder-m4-s0-4", 4, [0.5 * (i + 1) for i in range(4)])
    _run(tmp_path, "grpo-detection-iou50-s0-4", [1.0 * (i + 1) for i in range(4)])
    for name, max_steps in (("sft-s0-4", 8), ("rm-reorder-m4-s0-4", 8), ("grpo-detection-iou50-s0-4", 4)):
        _max_steps(tmp_path / name, max_steps)
    argv = ["--task", "image-random", "--steps", "4", "--from-runs", "--out", str(tmp_path)]
    assert ab_learning.main(argv) == 0
    lines = [json.loads(x) for x in (tmp_path / "ab.jsonl").read_text().splitlines() if '"summary"' not in x]
    by_arm = {
        a: [(x["step"], x["seconds"]) for x in lines if x["arm"] == a] for a in {x["arm"] for x in lines}
    }
    assert by_arm["sft"][0] == (4, 0.0) and by_arm["sft"][-1] == (8, pytest.approx(1.0))
    assert by_arm["rm-reorder-m4"] == [(4, 0.0), (8, pytest.approx(2.0))]
    assert by_arm["grpo-detection-iou50"] == [(4, 0.0), (8, pytest.approx(4.0))]

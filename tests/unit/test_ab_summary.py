"""bench/ab_learning.py's summary: paired differences over the seeds both arms finished, with a t interval."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ab_learning  # noqa: E402
from _ab import prepare, run_configs, run_folder, summary, tables  # noqa: E402


def _curve(f1: float) -> list[dict[str, float]]:
    return [{"step": 0, "f1": 0.5, "pred": 10.0}, {"step": 20, "f1": f1, "pred": 10.0}]


def test_paired_difference_uses_only_seeds_with_an_sft_run_and_carries_a_t_interval() -> None:
    curves = {("sft", 0): _curve(0.30), ("sft", 1): _curve(0.32), ("sft", 2): _curve(0.34)}
    curves |= {("grpo", 0): _curve(0.60), ("grpo", 1): _curve(0.64), ("grpo", 2): _curve(0.65)}
    curves[("grpo", 3)] = _curve(0.99)  # its sft run was cut off: reported, not paired
    line = {x["arm"]: x for x in summary.summarize("t", curves)}["grpo"]
    assert line["seeds"] == [0, 1, 2, 3] and line["paired_seeds"] == [0, 1, 2]
    assert line["paired_diff"] == pytest.approx([0.30, 0.32, 0.31])
    half = 4.302652729911275 * 0.01 / 3**0.5  # t(0.975, 2 dof) x sd / sqrt(n)
    assert line["paired_ci95"] == pytest.approx([0.31 - half, 0.31 + half])


def test_one_paired_seed_has_no_interval() -> None:
    curves = {("sft", 0): _curve(0.3), ("rm-reorder", 0): _curve(0.4)}
    line = {x["arm"]: x for x in summary.summarize("t", curves)}["rm-reorder"]
    assert line["paired_mean"] == pytest.approx(0.1) and "paired_ci95" not in line


@pytest.mark.parametrize("arm", sorted(tables.GRPO_ARMS))
def test_every_grpo_arm_gives_a_valid_run_config_with_its_learning_rate(arm: str, tmp_path: Path) -> None:
    import yaml

    from learner.grpo.main import resolve_grpo_config

    task = tables.TASKS["crowded-sorted"]
    (tmp_path / "base").mkdir()
    cfg = run_configs.grpo_run_config(
        tables.REPO / task["config"],
        {},
        grpo=tables.grpo_override(arm),
        model=str(tmp_path / "base"),
        run_dir=tmp_path / "run",
        seed=3,
        steps=20,
        eval_every=10,
        learning_rate=tables.GRPO_ARMS[arm].get("learning_rate", 1e-4),
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    resolved, run = resolve_grpo_config(path)
    assert run.training["learning_rate"] == tables.GRPO_ARMS[arm].get("learning_rate", 1e-4)
    assert resolved.grpo.reward_preset == tables.GRPO_ARMS[arm]["reward_preset"]


def _write_run(out: Path, name: str, points: list[tuple[int, float]]) -> None:
    """A run folder as the learner leaves it: ``metrics.jsonl`` with a training line and evaluations."""
    (out / name).mkdir(parents=True)
    lines = [{"step": 1, "loss": 1.0}]
    lines += [{"step": s, "eval_rollout_f1": f1, "eval_rollout_pred_objects": 10.0} for s, f1 in points]
    (out / name / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _from_runs(out: Path, *extra: str) -> dict[str, dict]:
    """``ab_learning --from-runs`` on ``out`` (20-step runs); the summary lines by arm."""
    assert (
        ab_learning.main(
            ["--task", "crowded-random", "--steps", "20", "--from-runs", "--out", str(out), *extra]
        )
        == 0
    )
    name = f"ab_at{extra[extra.index('--at-step') + 1]}.jsonl" if "--at-step" in extra else "ab.jsonl"
    lines = [json.loads(x) for x in (out / name).read_text().splitlines()]
    return {x["arm"]: x for x in lines if x.get("summary")}


def test_copied_runs_compare_at_a_step_every_seed_reached(tmp_path: Path) -> None:
    """`--from-runs --at-step`: a run cut off after its step-10 evaluation counts at step 10 and is left out
    at step 20; `--arms` keeps the named arms; unknown folders are ignored."""
    for seed, (sft10, sft20) in enumerate([(0.35, 0.27), (0.33, 0.26)]):
        _write_run(tmp_path, f"sft-s{seed}-20", [(0, 0.58), (10, sft10), (20, sft20)])
    _write_run(tmp_path, "rm-reorder-sorted-s0-20", [(0, 0.58), (10, 0.65), (20, 0.66)])
    _write_run(tmp_path, "rm-reorder-sorted-s1-20", [(0, 0.58), (10, 0.64)])  # cut off before step 20
    _write_run(tmp_path, "notes-s0-20", [(0, 0.1)])
    at10 = _from_runs(tmp_path, "--at-step", "10")
    assert at10["rm-reorder-sorted"]["paired_diff"] == pytest.approx([0.30, 0.31])
    assert (tmp_path / "ab_at10.png").stat().st_size > 0
    at20 = _from_runs(tmp_path, "--at-step", "20")
    assert at20["rm-reorder-sorted"]["seeds"] == [0] and at20["sft"]["seeds"] == [0, 1]
    assert set(_from_runs(tmp_path, "--arms", "sft")) == {"sft"}


def test_copied_runs_of_different_bases_are_refused(tmp_path: Path) -> None:
    _write_run(tmp_path, "sft-s0-20", [(0, 0.58), (20, 0.27)])
    _write_run(tmp_path, "rm-reorder-s0-20", [(0, 0.66), (20, 0.21)])  # another stage-1 build
    with pytest.raises(SystemExit, match=r"seed 0: the runs .* start from different bases .*--arms"):
        ab_learning.main(["--task", "crowded-random", "--steps", "20", "--from-runs", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no run folders"):
        ab_learning.main(
            ["--task", "crowded-random", "--steps", "20", "--from-runs", "--out", str(tmp_path / "empty")]
        )


def test_a_run_from_another_build_of_the_base_is_not_reused(tmp_path: Path) -> None:
    """A rebuilt base keeps its path, so `finished` also checks the run's stamp of the base's weights."""
    import yaml

    cfg = {"output_dir": str(tmp_path / "sft-s0-20"), "training": {"max_steps": 20}}
    _write_run(tmp_path, "sft-s0-20", [(0, 0.58), (20, 0.27)])
    run = tmp_path / "sft-s0-20"
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert run_folder.finished(run, cfg, 20, "a1")  # no stamp: a run from before stamping, taken as it is
    (run / run_folder.BASE_STAMP).write_text("a1\n")
    assert run_folder.finished(run, cfg, 20, "a1") and not run_folder.finished(run, cfg, 20, "b2")
    assert not run_folder.finished(run, cfg, 30, "a1")


def test_base_fingerprint_is_the_weights_sha256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    monkeypatch.setattr(prepare, "REPO", tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"weights")
    assert prepare.base_fingerprint({"model": "m"}) == hashlib.sha256(b"weights").hexdigest()
    assert prepare.base_fingerprint({"model": "absent"}) == ""

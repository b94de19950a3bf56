"""bench/ab_learning.py's two controls and its seconds: the `sft-canonical` arm (its base-order measurement,
its run config, its ordering), every arm paired with `sft` and `sft-canonical` by trained samples and by
training seconds, and the seconds themselves (evaluations excluded, GPU-seconds from the run's stamp)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ab_learning  # noqa: E402
from _ab import gpus, plots, run_configs, run_folder, summary, tables  # noqa: E402
from _ab import order as base_order  # noqa: E402

CANONICAL = tables.CANONICAL


def _curve(f1s: list[float], seconds: list[float] | None = None) -> list[dict[str, float]]:
    points = [{"step": 10 * i, "f1": f1, "pred": 10.0} for i, f1 in enumerate(f1s)]
    if seconds is not None:
        points = [{**p, "seconds": t} for p, t in zip(points, seconds, strict=True)]
    return points


def _lines(curves, **kwargs) -> dict[str, dict]:
    return {x["arm"]: x for x in summary.summarize("t", curves, **kwargs)}


def test_every_arm_is_paired_with_both_controls_by_trained_samples() -> None:
    curves = {}
    for seed, (sft, canonical, arm) in enumerate([(0.30, 0.60, 0.65), (0.34, 0.62, 0.61)]):
        curves |= {("sft", seed): _curve([0.5, sft]), (CANONICAL, seed): _curve([0.5, canonical])}
        curves[("rm-drop", seed)] = _curve([0.5, arm])
    lines = _lines(curves)
    arm = lines["rm-drop"]
    assert arm["paired_diff"] == pytest.approx([0.35, 0.27]) and arm["paired_seeds"] == [0, 1]
    assert arm["canonical_paired_diff"] == pytest.approx([0.05, -0.01])
    assert arm["canonical_paired_mean"] == pytest.approx(0.02) and len(arm["canonical_paired_ci95"]) == 2
    assert lines[CANONICAL]["paired_diff"] == pytest.approx([0.30, 0.28])  # the strong control vs the weak
    assert "canonical_paired_diff" not in lines[CANONICAL] and "paired_diff" not in lines["sft"]
    assert plots.arm_label(arm) == "rm-drop (n=2) vs sft +0.310, sft-canonical +0.020"


def test_without_a_canonical_run_only_the_weak_control_is_paired() -> None:
    curves = {("sft", 0): _curve([0.5, 0.3]), ("rm-drop", 0): _curve([0.5, 0.6])}
    line = _lines(curves)["rm-drop"]
    assert line["paired_mean"] == pytest.approx(0.3)
    assert not any(k.startswith("canonical_paired") for k in line)


def test_equal_seconds_interpolate_the_control_at_the_arms_final_seconds() -> None:
    """The arm takes 100 s for what the control trains in 40 s: the control never reached 100 s, so the
    headline pair is missing (counted), never the control's last evaluation; at 25 s both are interpolated."""
    curves = {
        (CANONICAL, 0): _curve([0.5, 0.55, 0.58], [0.0, 20.0, 40.0]),
        ("rm-drop", 0): _curve([0.5, 0.60, 0.70], [0.0, 50.0, 100.0]),
    }
    units = {(CANONICAL, 0): "gpu", ("rm-drop", 0): "gpu"}
    line = _lines(curves, units=units)["rm-drop"]
    assert line["canonical_paired_diff"] == pytest.approx([0.12])  # equal samples: the arm is ahead
    assert line["canonical_paired_at_seconds"] == [100.0]
    assert (
        line["canonical_paired_at_seconds_missing"] == [0] and line["canonical_paired_at_seconds_seeds"] == []
    )
    assert "canonical_paired_at_seconds_f1" not in line
    quarter = line["canonical_paired_at_fractions_f1"]["0.25"]  # 25 s: arm 0.55, control 0.5575
    assert quarter["seeds"] == [0] and quarter["mean"] == pytest.approx(0.55 - 0.5575)
    assert line["canonical_paired_seconds_ratio"] == pytest.approx([2.5])
    assert line["train_seconds"] == [100.0] and line["seconds_unit"] == ["gpu"]
    short = _lines(curves, units=units)[CANONICAL]["canonical_seconds_short"]
    assert short == [{"seed": 0, "arm": "rm-drop", "arm_seconds": 100.0, "canonical_seconds": 40.0}]
    # a faster arm: the control interpolated at the arm's 30 s (0.55 + 0.5 x 0.03)
    curves[("rm-drop", 0)] = _curve([0.5, 0.60, 0.70], [0.0, 10.0, 30.0])
    line = _lines(curves, units=units)["rm-drop"]
    assert line["canonical_paired_at_seconds_f1"]["diff"] == pytest.approx([0.70 - 0.565])
    assert "canonical_seconds_short" not in _lines(curves, units=units)[CANONICAL]


def test_seconds_of_different_units_are_not_paired() -> None:
    curves = {
        (CANONICAL, 0): _curve([0.5, 0.58], [0.0, 40.0]),
        ("rm-drop", 0): _curve([0.5, 0.70], [0.0, 100.0]),
    }
    line = _lines(curves, units={(CANONICAL, 0): "gpu", ("rm-drop", 0): "cpu"})["rm-drop"]
    assert "canonical_paired_diff" in line and "canonical_paired_at_seconds" not in line


def _metrics(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


ROWS = [  # as the learner logs them: training lines, an evaluation after its step, then train_runtime
    {"step": 0, "wall_s": 0.5, "eval_rollout_f1": 0.5, "eval_rollout_pred_objects": 9.0},
    {"step": 1, "wall_s": 1.5, "loss": 1.0},
    {"step": 2, "wall_s": 2.0, "loss": 1.0},
    {"step": 2, "wall_s": 7.0, "eval_rollout_f1": 0.6, "eval_rollout_pred_objects": 9.0},
    {"step": 3, "wall_s": 8.0, "loss": 1.0},
    {"step": 4, "wall_s": 9.5, "loss": 1.0},
    {"step": 4, "wall_s": 12.0, "eval_rollout_f1": 0.7, "eval_rollout_pred_objects": 9.0},
    {"step": 4, "wall_s": 12.0, "train_runtime": 11.5},
]


def test_training_seconds_leave_the_evaluations_out(tmp_path: Path) -> None:
    _metrics(tmp_path, ROWS)
    assert run_folder.step_seconds(tmp_path / "metrics.jsonl") == {1: 1.0, 2: 1.5, 3: 2.5, 4: 4.0}
    assert run_folder.step_seconds(tmp_path / "metrics.jsonl", after_step=2) == {3: 1.0, 4: 2.5}


@pytest.mark.parametrize(("stamp", "unit", "factor"), [(None, "wall", 1), (0, "cpu", 1), (2, "gpu", 2)])
def test_seconds_are_gpu_seconds_where_the_run_held_gpus(tmp_path: Path, stamp, unit, factor) -> None:
    _metrics(tmp_path, ROWS)
    if stamp is not None:
        (tmp_path / run_folder.DEVICE_STAMP).write_text(json.dumps({"gpus": stamp}))
    curve, got = run_folder.with_seconds(run_folder.eval_curve(tmp_path / "metrics.jsonl"), tmp_path)
    assert got == unit and [p["seconds"] for p in curve] == [0.0, 1.5 * factor, 4.0 * factor]


@pytest.mark.parametrize(
    ("order", "task_ordering", "expected"),
    [
        ({"follows": "sorted"}, "random", "sorted"),
        ({"follows": "listed"}, "random", "random"),
        ({"follows": None, "best": "sorted"}, "random", "random"),  # follows none: the task's own order
        (None, "sorted", "sorted"),
    ],
)
def test_the_canonical_arm_lists_the_annotations_in_the_order_the_base_follows(
    order, task_ordering, expected
) -> None:
    assert base_order.canonical_ordering(order, task_ordering) == expected


def test_the_canonical_run_config_is_plain_sft_from_the_base_in_that_order(tmp_path: Path) -> None:
    from learner.config import load_run_config

    task = tables.TASKS["text-random"]
    common = {
        "extends": str(tables.REPO / task["config"]),
        "data": {"train": ["t.jsonl"], "eval": ["e.jsonl"], "object_ordering": "random"},
        "training": {"report_to": []},
    }
    rollout = {"servers": [{"base_url": "http://127.0.0.1:1"}], "sync": {"transport": "http"}}
    cfg = run_configs.canonical_run_config(
        common,
        rollout,
        model=str(tmp_path / "checkpoint-150"),
        ordering="sorted",
        run_dir=tmp_path / "run",
        seed=2,
        steps=20,
        eval_every=10,
        learning_rate=3e-4,
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = load_run_config(path)
    assert run.data.object_ordering == "sorted" and run.stage2.sft_warmup_steps == 20
    assert run.stage2.eval.at_start and run.model.path == str(tmp_path / "checkpoint-150")
    assert run.training["max_steps"] == 20 and run.training["seed"] == 2
    assert run.training["learning_rate"] == 3e-4 and not run.save_final_model
    assert run_configs.samples_per_step(cfg) == run_configs.samples_per_step(common)
    no_base = run_configs.canonical_run_config(
        common, rollout, model=None, ordering="random", run_dir=tmp_path / "r", seed=0, steps=5,
        eval_every=5, learning_rate=None,
    )  # fmt: skip
    assert "model" not in no_base and "learning_rate" not in no_base["training"]
    assert "resume_from_checkpoint" not in cfg["training"]  # base_steps 0: a fresh optimizer and schedule


def test_the_canonical_run_resumes_the_sft_runs_base_checkpoint(tmp_path: Path) -> None:
    """After a shared plain-GT phase the control continues the sft run's optimizer and schedule (so in the
    task's own order it IS the sft run), and the sft run saves that checkpoint whole, not only the model."""
    common = {"extends": str(tables.REPO / tables.TASKS["text-random"]["config"]), "training": {}}
    rollout = {"servers": [{"base_url": "http://127.0.0.1:1"}]}
    base = str(tmp_path / "sft-s0-50" / "checkpoint-150")
    cfg = run_configs.canonical_run_config(
        common, rollout, model=base, ordering="sorted", run_dir=tmp_path / "c", seed=0, steps=200,
        eval_every=25, learning_rate=None, base_steps=150,
    )  # fmt: skip
    assert cfg["training"]["resume_from_checkpoint"] == base and cfg["model"]["path"] == base
    assert cfg["training"]["max_steps"] == 350 and cfg["stage2"]["sft_warmup_steps"] == 350
    sft = run_configs.stage2_run_config(
        common, rollout, {}, sft=True, run_dir=tmp_path / "s", seed=0, learning_rate=None, base_steps=150,
        steps=50, eval_every=25, saves_base=True,
    )  # fmt: skip
    assert sft["training"]["save_steps"] == 150 and not sft["training"].get("save_only_model", False)


def test_the_base_order_is_measured_by_the_evaluation_command(tmp_path: Path, monkeypatch) -> None:
    """The harness's glue: `python -m learner.evaluate` on the base (colocated HF, the seed's listing, the
    first N training rows), whose `object_order` it returns; a failed evaluation is an error with its log."""
    calls = []
    order = {"agreement": {"listed": 0.5, "sorted": 0.98}, "pairs": 300, "follows": "sorted"}

    def fake_run(command, **kwargs):
        calls.append(command)
        out = Path(command[command.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "metrics.json").write_text(json.dumps({"object_order": order}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(base_order.subprocess, "run", fake_run)
    run_dir = tmp_path / "sft-canonical-s1-20"
    common = {"data": {"object_ordering": "random"}, "training": {"report_to": []}}
    got = base_order.measure_base_order(
        common, model="/base", train=tmp_path / "train.jsonl", run_dir=run_dir, seed=1, n_items=32
    )
    assert got == order and base_order.read_order(run_dir) == order
    command = calls[0]
    assert command[1:3] == ["-m", "learner.evaluate"] and command[command.index("--model") + 1] == "/base"
    assert command[command.index("--limit") + 1] == "32"
    assert command[command.index("--data") + 1] == str(tmp_path / "train.jsonl")
    cfg = yaml.safe_load((run_dir / "base_order.yaml").read_text())
    assert cfg["rollout"]["mode"] == "colocate" and cfg["rollout"]["backend"] == "hf"
    assert cfg["training"]["seed"] == 1 and cfg["data"]["object_ordering"] == "random"

    def failing(command, **kwargs):
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(base_order.subprocess, "run", failing)
    with pytest.raises(SystemExit, match="measuring the base's order failed with exit code 1"):
        base_order.measure_base_order(
            common, model="/base", train=tmp_path / "t", run_dir=tmp_path / "x", seed=0, n_items=8
        )


def test_copied_runs_report_both_controls_the_base_order_and_seconds(tmp_path: Path) -> None:
    """`--from-runs` over sft, sft-canonical (with its order measurement) and an arm: both pairings, the
    base order in the canonical line, GPU-seconds from the runs' stamps, the PNG."""
    for arm, f1s in (("sft", (0.3, 0.2)), (CANONICAL, (0.62, 0.66)), ("rm-reorder-sorted", (0.64, 0.65))):
        run = tmp_path / f"{arm}-s0-4"
        rows = [dict(r) for r in ROWS]
        rows[3]["eval_rollout_f1"], rows[6]["eval_rollout_f1"] = f1s
        _metrics(run, rows)
        (run / run_folder.DEVICE_STAMP).write_text(json.dumps({"gpus": 1}))
        (run / "run.yaml").write_text(yaml.safe_dump({"data": {"object_ordering": "sorted"}}))
    order = {"agreement": {"listed": 0.49, "sorted": 0.97}, "pairs": 800, "follows": "sorted"}
    (tmp_path / f"{CANONICAL}-s0-4" / base_order.ORDER_DIR).mkdir()
    (tmp_path / f"{CANONICAL}-s0-4" / base_order.ORDER_DIR / "metrics.json").write_text(
        json.dumps({"object_order": order})
    )
    argv = ["--task", "crowded-random", "--steps", "4", "--from-runs", "--out", str(tmp_path)]
    assert ab_learning.main(argv) == 0
    lines = [json.loads(x) for x in (tmp_path / "ab.jsonl").read_text().splitlines()]
    summary = {x["arm"]: x for x in lines if x.get("summary")}
    arm = summary["rm-reorder-sorted"]
    assert arm["paired_diff"] == pytest.approx([0.45]) and arm["canonical_paired_diff"] == pytest.approx(
        [-0.01]
    )
    assert arm["train_seconds"] == [4.0] and arm["seconds_unit"] == ["gpu"]
    assert arm["canonical_paired_at_seconds_f1"]["diff"] == pytest.approx([-0.01])
    assert summary[CANONICAL]["base_order"] == [{**order, "ordering": "sorted"}]
    assert all("seconds" in x for x in lines if not x.get("summary"))
    assert (tmp_path / "ab.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arms", "sft,sft-canonical", "--order-samples", "0"], "--order-samples 0 must be >= 1"),
        (["--arms", "sft,sft-canonicl"], "unknown arm"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_built(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        ab_learning.main(["--out", "/nonexistent/ab", *argv])
    assert message in capsys.readouterr().err


def test_gpu_seconds_count_each_gpu_once(tmp_path: Path) -> None:
    """A run holds the learner's GPU and the harness's server's: a server on the learner's GPU (one GPU, or
    `server.gpus: [0]` with the learner on GPU 0) adds none; on another GPU it adds one; no server (in-process
    rollouts, or another host's) adds none; a CPU host holds none."""
    assert gpus.held_gpus([], ["0"]) == 0
    assert gpus.held_gpus(["0"], None) == 1
    assert gpus.held_gpus(["0"], ["0"]) == 1 and gpus.held_gpus(["0", "1"], ["1"]) == 2
    assert gpus.held_gpus(["0", "1", "2"], ["1", "2"]) == 3
    server = tmp_path / "server.yaml"
    server.write_text(yaml.safe_dump({"server": {"model": "m"}}))
    assert gpus.server_gpus(server, ["0", "1"]) == ["0"]  # it inherits the harness's GPUs: the learner's one
    assert gpus.held_gpus(["0", "1"], gpus.server_gpus(server, ["0", "1"])) == 1
    server.write_text(yaml.safe_dump({"server": {"model": "m", "gpus": [0]}}))
    assert gpus.held_gpus(["0"], gpus.server_gpus(server, ["0"])) == 1
    server.write_text(yaml.safe_dump({"server": {"model": "m", "gpus": [1]}}))
    assert gpus.held_gpus(["0", "1"], gpus.server_gpus(server, ["0", "1"])) == 2


def test_a_control_trained_longer_is_paired_by_seconds_not_mid_way_by_samples() -> None:
    """The control sized to the arm's seconds trains 4 evaluations' worth where the arm trains 2: by samples
    it would be read mid-way through a longer schedule, so that pair is left out (and said); by seconds the
    control is interpolated at the arm's 100 s, for every paired figure."""
    curves = {
        (CANONICAL, 0): _curve([0.5, 0.55, 0.58, 0.62, 0.66], [0.0, 26.0, 52.0, 78.0, 104.0]),
        ("rm-drop", 0): _curve([0.5, 0.60, 0.70], [0.0, 50.0, 100.0]),
    }
    for curve, precision in ((curves[(CANONICAL, 0)], 0.8), (curves[("rm-drop", 0)], 0.9)):
        for p in curve:
            p |= {"precision": precision, "recall": 0.5, "duplicates": 1.0, "pred_gt_ratio": 1.1}
    units = {(CANONICAL, 0): "cpu", ("rm-drop", 0): "cpu"}
    line = _lines(curves, units=units)["rm-drop"]
    assert "canonical_paired_diff" not in line and line["canonical_paired_samples_unpaired"] == [0]
    f1 = line["canonical_paired_at_seconds_f1"]
    assert f1["control"] == pytest.approx([0.62 + 0.04 * 22 / 26]) and f1["arm"] == [0.70]
    assert line["canonical_paired_at_seconds_precision"]["diff"] == pytest.approx([0.1])
    assert line["canonical_paired_at_seconds_duplicates"]["diff"] == pytest.approx([0.0])
    assert set(line) >= {f"canonical_paired_at_seconds_{k}" for k in ("recall", "pred_gt_ratio")}


def test_a_control_sized_to_a_slower_arm_is_not_the_cheaper_arms_control() -> None:
    """Seed 0's control was sized to rm-reorder's 100 s: read at rm-reorder-m4's 40 s it is mid-way through
    a schedule 2.5 x longer, so m4's pair at seconds is left out there (and said), while rm-reorder's own
    run, timed at 95 s, is within the tolerance of the 100 s it was sized to. Seed 1's control was sized to
    m4 itself: m4 is paired there, and rm-reorder's pair is missing (its control stops short of it)."""
    curves, budgets = {}, {}
    for seed, sized_for in ((0, "rm-reorder"), (1, "rm-reorder-m4")):
        seconds = 100.0 if sized_for == "rm-reorder" else 40.0
        budgets[seed] = {"steps": 300, "arm": sized_for, "arm_seconds": seconds}
        curves[(CANONICAL, seed)] = _curve([0.5, 0.55, 0.6], [0.0, seconds / 2, seconds])
        curves[("rm-reorder", seed)] = _curve([0.5, 0.6, 0.7], [0.0, 50.0, 95.0])
        curves[("rm-reorder-m4", seed)] = _curve([0.5, 0.6, 0.7], [0.0, 20.0, 40.0])
    units = dict.fromkeys(curves, "cpu")
    lines = _lines(curves, units=units, budgets=budgets)
    m4, reorder = lines["rm-reorder-m4"], lines["rm-reorder"]
    assert m4["canonical_paired_stretched"] == [0] and m4["canonical_paired_at_seconds_seeds"] == [1]
    assert "paired_stretched" not in m4  # the weak control is never sized
    assert "canonical_paired_stretched" not in reorder
    assert reorder["canonical_paired_at_seconds_seeds"] == [0]
    assert reorder["canonical_paired_at_seconds_missing"] == [1]


def test_the_base_steps_must_be_an_evaluation(capsys) -> None:
    argv = [
        "--out",
        "/nonexistent/ab",
        "--arms",
        "sft,sft-canonical",
        "--base-steps",
        "20",
        "--eval-every",
        "3",
    ]
    with pytest.raises(SystemExit):
        ab_learning.main([*argv, "--steps", "6"])
    assert "must be multiples of --eval-every 3" in capsys.readouterr().err


def test_colocated_arms_roll_out_on_the_chosen_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--colocate-backend`: vLLM prices rollouts as a one-GPU user pays for them; `auto` falls back to HF
    where CUDA or vLLM is missing (this CPU host); the server arms are unchanged."""
    vllm = run_configs.rollout_section(colocate=True, url=None, shm_dir=None, backend="vllm")
    assert (vllm["mode"], vllm["backend"]) == ("colocate", "vllm") and "sleep_level" not in vllm["vllm"]
    hf = run_configs.rollout_section(colocate=True, url=None, shm_dir=None, backend="hf")
    assert (hf["mode"], hf["backend"]) == ("colocate", "hf")
    assert run_configs.colocate_backend("auto") == "hf" and run_configs.colocate_backend("vllm") == "vllm"
    server = run_configs.rollout_section(colocate=False, url="http://h:1", shm_dir=None, backend="vllm")
    assert server == {"servers": [{"base_url": "http://h:1"}], "sync": {"transport": "http"}}
    # on a GPU: the one-GPU split, or the memory share and sleep level of runs side by side
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = run_configs.rollout_section(colocate=True, url=None, shm_dir=None, backend="vllm")
    assert gpu["vllm"] == run_configs.COLOCATED_VLLM
    side_by_side = {"gpu_memory_utilization": 0.06, "sleep_level": 0}
    gpu = run_configs.rollout_section(colocate=True, url=None, shm_dir=None, backend="vllm", **side_by_side)
    assert gpu["vllm"] == {**run_configs.COLOCATED_VLLM, **side_by_side}
    # the command line's flags reach it (a flag parsed but never passed on went unnoticed once)
    flags = [
        "--colocate",
        "--colocate-backend",
        "vllm",
        "--vllm-gpu-memory",
        "0.06",
        "--vllm-sleep-level",
        "0",
    ]
    args = ab_learning.build_parser().parse_args(flags)
    assert run_configs.run_rollout(args, None, None)["vllm"] == {**run_configs.COLOCATED_VLLM, **side_by_side}
    # the GRPO arms keep their HF engine unless asked; with vLLM they take the same engine keys
    assert run_configs.grpo_rollout(args) is None
    args = ab_learning.build_parser().parse_args([*flags, "--grpo-colocate-backend", "vllm"])
    grpo = run_configs.grpo_rollout(args)
    assert grpo == {"backend": "vllm", "vllm": {**run_configs.COLOCATED_VLLM, **side_by_side}}


def test_a_grpo_arm_on_colocated_vllm_is_a_valid_grpo_run(tmp_path: Path) -> None:
    """`--grpo-colocate-backend vllm`: the GRPO arm's config passes GRPO's own validation with the colocated
    vLLM engine, and keeps the decoding and batch `grpo_config_from_sft` derived."""
    from learner.grpo.config.validate import validate_grpo_run

    task = tables.TASKS["image-random"]
    common = {"extends": str(tables.REPO / task["config"]), "model": {"path": str(tmp_path)}}
    engine = {"enforce_eager": True, "kv_cache_space_gb": 1, "max_model_len": 2048}
    kwargs = {"grpo": {"reward_preset": "detection_iou50"}, "model": str(tmp_path), "run_dir": tmp_path / "g"}
    kwargs |= {"seed": 0, "steps": 2, "eval_every": 2, "learning_rate": 1e-4}
    cfg = run_configs.grpo_run_config(
        tables.REPO / task["config"], common, rollout={"backend": "vllm", "vllm": engine}, **kwargs
    )
    assert cfg["rollout"]["mode"] == "colocate" and cfg["rollout"]["backend"] == "vllm"
    assert cfg["rollout"]["vllm"] == engine
    assert cfg["rollout"]["decoding"]["rollout_generate_batch_size"] == 16  # the step's completions
    run = validate_grpo_run(yaml.safe_load(yaml.safe_dump(cfg)), tables.REPO)
    assert run.learner_config["rollout"]["backend"] == "vllm" and run.world_size == 1


def test_an_arm_that_reuses_rollouts_resumes_the_base_instead_of_training_it(tmp_path: Path) -> None:
    """The rollout buffer repeats every dataloader window, the base phase's too: the reuse arm resumes the
    sft run's base checkpoint (evaluated first, as the base) and keeps the buffer; the others train it."""
    from learner.config import load_run_config

    assert all(tables.reuses_rollouts(f"rm-reorder-m{m}") for m in (2, 4, 8))
    assert not tables.reuses_rollouts("rm-reorder")
    assert tables.ARMS["rm-reorder-m8"]["rollout_buffer"]["m_steps"] == 8
    assert tables.resumes_base("rm-reorder-m4") and tables.resumes_base(CANONICAL)
    assert not tables.resumes_base("rm-reorder") and not tables.resumes_base("sft")
    common = {"extends": str(tables.REPO / tables.TASKS["image-random"]["config"]), "training": {}}
    common["data"] = {"train": ["t.jsonl"], "eval": ["e.jsonl"]}
    rollout = {"servers": [{"base_url": "http://127.0.0.1:1"}], "sync": {"transport": "http"}}
    base = str(tmp_path / "sft-s0-50" / "checkpoint-150")
    kwargs = {
        "sft": False,
        "seed": 0,
        "learning_rate": None,
        "base_steps": 150,
        "steps": 50,
        "eval_every": 50,
    }
    cfg = run_configs.stage2_run_config(
        common, rollout, tables.ARMS["rm-reorder-m4"], run_dir=tmp_path / "m4", saves_base=True, base=base,
        **kwargs,
    )  # fmt: skip
    (tmp_path / "m4.yaml").write_text(yaml.safe_dump(cfg))
    run = load_run_config(tmp_path / "m4.yaml")
    assert cfg["training"]["resume_from_checkpoint"] == base and run.model.path == base
    assert run.stage2.rollout_buffer.enabled and run.stage2.rollout_buffer.m_steps == 4
    assert (
        run.stage2.eval.at_start and run.stage2.sft_warmup_steps == 150 and run.training["max_steps"] == 200
    )
    trains = run_configs.stage2_run_config(
        common, rollout, tables.ARMS["rm-reorder"], run_dir=tmp_path / "r", saves_base=True, **kwargs
    )
    assert "resume_from_checkpoint" not in trains["training"] and not trains["stage2"]["eval"]["at_start"]

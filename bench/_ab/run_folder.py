"""Reading a run folder: its held-out evaluations (``metrics.jsonl``), its training seconds, its stamps, and
whether it is already the run asked for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from learner.report import load_metrics


def eval_curve(metrics: Path) -> list[dict[str, float]]:
    """Per evaluation: the step, ``f1`` (gate F1), ``pred`` (predicted objects) and every other
    ``eval_rollout_*`` figure of the breakdown (precision, recall, F1 at maskIoU 0.5 / 0.75, duplicates,
    predicted ÷ GT, …) under its name without the prefix."""
    prefix = "eval_rollout_"
    return [
        {
            "step": int(r["step"]),
            "f1": r["eval_rollout_f1"],
            "pred": r["eval_rollout_pred_objects"],
            **{
                k.removeprefix(prefix): v for k, v in r.items() if k.startswith(prefix) and k != f"{prefix}f1"
            },
        }
        for r in load_metrics(metrics)
        if "eval_rollout_f1" in r
    ]


LAYOUT_ONLY = ("gpu_memory_utilization", "sleep_level")
"""``rollout.vllm`` keys that place the colocated engine on the GPU without changing what it generates (its
memory share, whether it sleeps between rollouts): a run that differs only there is the same run (the
pricing seed runs alone with the one-GPU split, the other seeds side by side with a small share)."""


BASE_STAMP = "base.sha256"
"""File in a run folder: the sha256 of the task's base weights the run started from."""


def finished(run_dir: Path, cfg: dict[str, Any], total: int, base: str = "") -> bool:
    """Whether ``run_dir`` holds this run already: its last evaluation is at step ``total``, its
    ``run.yaml`` is ``cfg`` apart from where rollouts came from (the server's address and staging dir change
    from one harness invocation to the next; the runs are deterministic whichever server serves them) and
    where a colocated engine sat (:data:`LAYOUT_ONLY`), and it
    started from the base whose fingerprint is ``base`` (a run folder without a stamp predates stamping and
    is taken as it is)."""
    metrics, path = run_dir / "metrics.jsonl", run_dir / "run.yaml"
    if not metrics.exists() or not path.exists():
        return False
    stamp = run_dir / BASE_STAMP
    if base and stamp.exists() and stamp.read_text().strip() != base:
        print(f"[ab] {run_dir.name}: trained from another build of the base; training it again", flush=True)
        return False
    curve = eval_curve(metrics)
    if not curve or curve[-1]["step"] != total:
        return False

    def comparable(config: dict[str, Any]) -> dict[str, Any]:
        rollout = {k: v for k, v in config.get("rollout", {}).items() if k not in ("servers", "sync")}
        if isinstance(rollout.get("vllm"), dict):  # the engine's memory share and sleep: same rollouts
            rollout["vllm"] = {k: v for k, v in rollout["vllm"].items() if k not in LAYOUT_ONLY}
        return {**config, "rollout": rollout}

    return comparable(yaml.safe_load(path.read_text())) == comparable(cfg)


DEVICE_STAMP = "device.json"
"""File in a run folder: ``{"gpus": N}``, the GPUs the run held (0 on a CPU host; `_ab.gpus.held_gpus`),
written once it trained."""


def step_seconds(metrics: Path, after_step: int = 0) -> dict[int, float]:
    """Seconds the run spent training its steps after ``after_step``, cumulated up to each logged step: per
    training line (one with ``loss``), its ``wall_s`` minus the previous line's, so that the evaluations the
    learner logs between steps are not counted (seconds of training, not of measuring it). A run that starts
    from the base (GRPO, ``sft-canonical``) pays its first step's warm-up here; the stage-2 arms paid theirs
    in the shared base phase (on the CPU smoke ~0.8 s of 2 steps; small against real runs' steps)."""
    out: dict[int, float] = {}
    total = previous = 0.0
    for row in load_metrics(metrics):
        if row.get("wall_s") is None:
            continue
        if "loss" in row and int(row["step"]) > after_step:
            total += float(row["wall_s"]) - previous
            out[int(row["step"])] = total
        previous = float(row["wall_s"])
    return out


def seconds_unit(run_dir: Path) -> tuple[str, int]:
    """``(unit, factor)`` of a run's seconds from its :data:`DEVICE_STAMP`: ``gpu`` (GPU-seconds: wall seconds
    x the GPUs it held), ``cpu`` (wall seconds on a CPU host), ``wall`` (a run from before the stamp)."""
    stamp = run_dir / DEVICE_STAMP
    if not stamp.exists():
        return "wall", 1
    gpus = int(json.loads(stamp.read_text())["gpus"])
    return ("gpu", gpus) if gpus > 0 else ("cpu", 1)


def with_seconds(
    curve: list[dict[str, float]], run_dir: Path, after_step: int = 0
) -> tuple[list[dict[str, float]], str]:
    """``curve`` with ``seconds`` at each evaluation (:func:`step_seconds` after ``after_step``, in the run's
    :func:`seconds_unit`; 0 at the base) and that unit. Call before shifting a curve's steps."""
    unit, factor = seconds_unit(run_dir)
    cumulative = step_seconds(run_dir / "metrics.jsonl", after_step)
    out = []
    for point in curve:
        done = [t for step, t in cumulative.items() if step <= point["step"]]
        out.append({**point, "seconds": round(factor * max(done, default=0.0), 3)})
    return out, unit


def last_step(run_dir: Path, run_steps: int) -> int:
    """The learner step a finished run of ``run_dir`` evaluates last: its ``run.yaml``'s
    ``training.max_steps`` (a supervised arm's shared base steps included; a GRPO run counts from its base
    checkpoint), else ``run_steps`` (a folder without its config)."""
    path = run_dir / "run.yaml"
    config = yaml.safe_load(path.read_text()) if path.exists() else None
    max_steps = (config or {}).get("training", {}).get("max_steps")
    return int(max_steps) if max_steps else run_steps


def base_steps_of(run_dir: Path, run_steps: int) -> int:
    """The plain-GT base steps before the ``run_steps`` of its recipe that a run's step count includes
    (:func:`last_step` − ``run_steps``): the shared base of a supervised arm, trained or resumed; 0 for a run
    that counts its own steps from its base checkpoint (GRPO, a control from a stage-1)."""
    return max(last_step(run_dir, run_steps) - run_steps, 0)


def recipe_curve(run_dir: Path, base_steps: int) -> tuple[list[dict[str, float]], str]:
    """A run's evaluations from its base on, with the seconds of its recipe's steps (:func:`with_seconds`
    after ``base_steps``) and their unit: the base's evaluation (at ``base_steps``; a run that resumed the
    base checkpoint logs it at step 0) and every later one. The seconds and steps of the base phase a
    supervised arm trained itself are left out: they are the same for every arm of a seed."""
    curve = [{**p, "step": p["step"] or base_steps} for p in eval_curve(run_dir / "metrics.jsonl")]
    return with_seconds([p for p in curve if p["step"] >= base_steps], run_dir, base_steps)

"""A/B of learning recipes: K seeds x arms, equal steps and samples, held-out F1 over seeds.

    python bench/ab_learning.py --task text-random --arms sft,rm-keep,rm-drop,rm-reorder --seeds 0,1,2
    python bench/ab_learning.py --task image-random --colocate  # a GPU machine without vLLM
    python bench/ab_learning.py --task crowded-random --colocate --base-steps 0 --arms sft,sft-canonical
    python bench/ab_learning.py --smoke --server-url URL        # the CI smoke (< 1 min on a running server)

A task is a demo config plus its object order (``TASKS``: text or image demo, ``sorted`` or ``random``). Every
run of a seed starts with the same ``--base-steps`` of plain-GT training (the demo's own stage 1: runs are
deterministic, so this phase is one checkpoint shared by the seed's arms, optimizer state included), then
trains ``--steps`` more with its arm's recipe (``ARMS``: a ``stage2`` override, exactly what a user writes
in YAML). ``sft`` is the weak control: plain GT for the same steps and samples, in the task's order. The
strong control is ``sft-canonical`` (``CANONICAL``): plain GT from the same base for the same steps, listed
in the order the base itself follows, measured before it trains on the base's greedy rollouts of
``--order-samples`` training rows (``python -m learner.evaluate``'s ``object_order``,
`learner.evaluate.order`: the share of pairs of matched predictions each known order ranks as the model
emitted them), so an on-policy arm has to beat more than the fix of the order. The held-out F1 is evaluated
every ``--eval-every`` steps on ``--eval-samples`` rows (greedy; 64 rows move F1 by about +-0.05 between
equivalent runs, so 256 and three seeds are the minimum for a 0.03 claim).

GRPO arms (``GRPO_ARMS``, ``--colocate`` only: e.g. ``grpo-detection``, GRPO with ``grpo.reward_preset:
detection``) start from the same base: the sft run of the seed saves its weights at ``--base-steps``
(``checkpoint-<base>``, the plain-GT phase every arm shares; with ``--base-steps 0`` the task's model), and
GRPO trains ``--steps`` steps from there (``learner.grpo``, rollouts by the HF engine in-process; constant
``--grpo-learning-rate``, a fresh optimizer), evaluated by the rollout-matching evaluator on the same held-out
rows with the same greedy decoding (``learner.grpo.evaluation``); its steps are shifted by the base steps in
``ab.jsonl``. ``sft-canonical`` starts from that base the same way (its annotation order is not the shared
phase's), with the supervised arms' learning rate and schedule. Trained samples: a plain-GT or
rollout-matching step trains ``per_device_train_batch_size x gradient_accumulation_steps`` samples; a GRPO
step trains ``prompts x num_generations`` completions, and the arm uses ``(that batch) / GRPO_GENERATIONS``
prompts per step, so every arm trains the same number of samples per step (``trained_samples`` in the
summary counts the steps after the base). Training seconds: each evaluation carries ``seconds``, the wall
seconds the run spent in its steps after the base (evaluations excluded; ``step_seconds``), times the GPUs
the run held on a GPU host (GPU-seconds: the learner's, plus the rollout server's when the harness started
it) — ``train_seconds`` and ``seconds_unit`` per run in the summary (``gpu``, or ``cpu`` wall seconds).

Writes ``runs/ab/<task>/ab.jsonl`` (one line per evaluation; then per arm: the final F1 per seed, mean, sd and
the PAIRED difference to each control of the same seed — ``paired_*`` to ``sft``, ``canonical_paired_*`` to
``sft-canonical`` — at equal trained samples and, ``*_at_seconds_*``, at equal training seconds; the
``sft-canonical`` line holds the base order measured per seed), ``ab.png`` (F1, precision, recall, F1 at
maskIoU 0.5, duplicates and predicted ÷ GT by step, and F1 by training seconds: mean line and min-max band per
arm, the controls dashed, each arm's paired mean against both controls in the legend) and, with a GRPO
arm, ``grpo.png`` (reward, KL, completion length per step). One rollout server (the task config's
``server:`` section) serves every run unless ``--server-url`` names one or ``--colocate`` rolls out
in-process; a run's first rollout step syncs its weights, so runs can share a server. Finished runs are reused
(delete the run directory to redo one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from learner.grpo.config import grpo_config_from_sft  # noqa: E402
from learner.training_config import TrainingConfig  # noqa: E402
from shared_schemas.config import ConfigError, deep_merge  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

ARMS: dict[str, dict[str, Any]] = {
    "sft": {},
    "rm-keep": {"targets": {"unmatched_prefix": "keep"}},
    "rm-drop": {"targets": {"unmatched_prefix": "drop"}},
    "rm-reorder": {"targets": {"unmatched_prefix": "reorder", "reorder_orders": ["listed"]}},
    # the crowded tasks' base saw sorted answers: its rollouts follow the anchor order whatever the GT lists
    "rm-reorder-sorted": {"targets": {"unmatched_prefix": "reorder", "reorder_orders": ["listed", "sorted"]}},
}
"""Arm name → ``stage2`` override (deep-merged over the task config's stage2). Every arm trains on the plain
GT for ``--base-steps`` (identical across arms for a seed: the runs are deterministic), then ``sft`` continues
on the plain GT and the others roll out."""

CANONICAL = "sft-canonical"
"""The strong control: plain SFT from the seed's base on the annotations in the order the base itself follows,
measured on its own rollouts of ``--order-samples`` training items (:func:`measure_base_order`); the base's
habit then costs plain SFT nothing, so an on-policy arm must beat more than the order fix."""
CONTROLS = ("sft", CANONICAL)
"""The controls every other arm is paired with: ``sft`` (plain GT in the task's order, the weak control: on a
random-order task it fights the base's order habit) and :data:`CANONICAL` (the strong one)."""
ORDERING_OF = {"sorted": "sorted"}
"""A measured order (`learner.stage2.targets.order.ORDER_NAMES`) → the ``data.object_ordering`` that lists the
annotations in it; ``listed`` is the task's own ordering."""

GRPO_ARMS: dict[str, dict[str, Any]] = {
    "grpo-detection": {"reward_preset": "detection"},
    "grpo-detection-dedup": {"reward_preset": "detection_dedup"},
    # dedup's precision term paid for dropping real objects (pred ÷ GT 0.73 on the image demo): the count term
    # prices a wrong count from both sides instead
    "grpo-detection-count": {"reward_preset": "detection_count"},
    "grpo-count-lr1e-5": {"reward_preset": "detection_count", "learning_rate": 1e-5},
    # with the count right, GRPO still lost box tightness to plain SFT: F1 at maskIoU 0.5, not at the gate
    "grpo-detection-iou50": {"reward_preset": "detection_iou50"},
    # sampling at T 1.0 spreads ~600-token completions mostly by noise; a cooler policy gives groups whose
    # rewards differ by the detections
    "grpo-dedup-t07": {"reward_preset": "detection_dedup", "temperature": 0.7},
    # the field's GRPO rates are 1e-6 – 1e-5; these arms pin theirs whatever --grpo-learning-rate says, so one
    # invocation compares rates on the same bases
    "grpo-dedup-lr1e-5": {"reward_preset": "detection_dedup", "learning_rate": 1e-5},
    "grpo-dedup-lr3e-6": {"reward_preset": "detection_dedup", "learning_rate": 3e-6},
}
"""Arm name → ``grpo`` override of a GRPO run from the seed's base checkpoint (:func:`grpo_run_config`); an
arm's ``learning_rate`` is the run's (else ``--grpo-learning-rate``), not a ``grpo`` key."""
GRPO_GENERATIONS = 4
"""Completions per prompt of the GRPO arms."""

TASKS: dict[str, dict[str, Any]] = {
    **{
        name: {"config": f"configs/demo_{kind}_cpu.yaml", "kind": kind, "ordering": ordering, "model": model}
        for kind, model in (
            ("tiny", ".cache/models/tiny-qwen2-copy"),
            ("vlm", ".cache/models/tiny-qwen3-vl-demo"),
        )
        for ordering in ("sorted", "random")
        for name in [f"{'text' if kind == 'tiny' else 'image'}-{ordering}"]
    },
    **{
        f"crowded-{ordering}": {
            "config": "configs/crowded_vlm_gpu.yaml",
            "kind": "crowded",
            "ordering": ordering,
            "model": ".cache/models/tiny-qwen3-vl-crowded",  # one base for both orders (sorted stage-1)
        }
        for ordering in ("sorted", "random")
    },
}
"""Task name → config, kind (``tiny`` text demo, ``vlm`` image demo, ``crowded`` crowded images), object order
and the base model. The crowded tasks' base is a stage-1 trained here (:func:`build_crowded_stage1`)."""


SHM_DIR = f"/dev/shm/rollmatch-ab-{os.getpid()}"
"""The harness's server and learners share this staging dir (shm syncs), apart from any other server's."""


def base_model(task_config: Path, common: dict[str, Any]) -> str:
    """The task's starting model (``common``'s ``model.path``, else the task config's), absolute."""
    from learner.yaml_loader import load_yaml_with_extends

    path = common.get("model", {}).get("path") or load_yaml_with_extends(task_config)["model"]["path"]
    return str(Path(path) if Path(path).is_absolute() else REPO / path)


def samples_per_step(cfg: dict[str, Any]) -> int:
    """Samples one optimizer step of the run ``cfg`` trains (its ``extends`` resolved): per-device batch x
    gradient accumulation (one process); a GRPO step's completions, ``prompts x num_generations``."""
    from learner.yaml_loader import load_yaml_with_extends

    tree = cfg
    if "extends" in cfg:
        tree = deep_merge(
            load_yaml_with_extends(cfg["extends"]), {k: v for k, v in cfg.items() if k != "extends"}
        )
    return TrainingConfig.model_validate(tree.get("training") or {}).samples_per_step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(task: dict[str, Any], data: Path, stage1: dict[str, Any]) -> None:
    """The task's starting model, as ``scripts/demo.sh`` builds it, or the crowded stage-1 (idempotent)."""
    if task["kind"] == "crowded":
        build_crowded_stage1(Path(task["model"]), data, **stage1)
        return
    script = (
        ["scripts/build_tiny_models.py", "--out", ".cache/models"]
        if task["kind"] == "tiny"
        else ["scripts/build_tiny_vlm.py", "--out", ".cache/models", "--preset", "tiny-qwen3-vl-demo"]
    )
    subprocess.run([PY, *script], cwd=REPO, check=True, stdout=subprocess.DEVNULL)


STAGE1_RECIPE = "sorted-b64-lr1e-3-fast-learner-token-path"
"""Names the crowded stage-1 recipe; a cached base built by another (e.g. before vlm_pretrain trained the
learner's token path) is rebuilt."""


def build_crowded_stage1(
    model: Path,
    data: Path,
    *,
    steps: int,
    every: int,
    target_f1: float,
    device: str,
    eval_from: int = 0,
    n_eval: int = 64,
    max_new_tokens: int = 1024,
    batch: int = 64,
) -> None:
    """Stage-1 of the crowded model, trained here and cached in ``model`` (``REPO``-relative).

    ``scripts/vlm_pretrain.py --fast`` trains the random-init ``tiny-qwen3-vl-crowded-init`` on ``data``'s
    train split in SORTED object order whatever the task's order (``batch`` rows, lr 1e-3), scoring ``n_eval``
    held-out images and saving a snapshot every ``every`` steps from step ``eval_from`` on (earlier snapshots
    generate up to ``max_new_tokens`` of noise per image and cannot reach the target). Sorted, because only
    that localises within a device call (2026-11-27, one H200 each, ~1,150 steps in 400 s: held-out F1 0.78
    sorted vs 0.16 in random order; bench/RESULTS.md "Crowded scenes"); the random-order task then fine-tunes
    a model with an order habit on annotations in arbitrary order, as users fine-tune a pretrained VLM. The
    base is the FIRST snapshot whose held-out F1 reaches ``target_f1`` (else the best), so that every arm has
    room above it. The choice is written to ``stage1_choice.json``; a model folder holding one is reused.
    ``--fast`` kernels are not bitwise reproducible: the choice file records the F1.
    """
    model = REPO / model
    choice_file = model / "stage1_choice.json"
    if choice_file.exists() and json.loads(choice_file.read_text()).get("recipe") == STAGE1_RECIPE:
        return
    init = REPO / ".cache/models/tiny-qwen3-vl-crowded-init"
    subprocess.run(
        [PY, "scripts/build_tiny_vlm.py", "--out", str(init.parent), "--preset", init.name],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    tmp, snapshots = model.with_name(model.name + ".build"), model.with_name(model.name + ".snapshots")
    marks = ",".join(str(k) for k in range(every, steps + 1, every) if k >= eval_from)
    t0 = time.time()
    subprocess.run(
        [PY, "scripts/vlm_pretrain.py", "--model-dir", str(init), "--data", str(data), "--out", str(tmp)]
        + ["--device", device, "--steps", str(steps), "--batch", str(batch), "--lr", "1e-3", "--fast"]
        + ["--n-eval", str(n_eval)]
        + ["--max-new-tokens", str(max_new_tokens), "--object-ordering", "sorted", "--eval-at", marks]
        + ["--snapshot-at", marks, "--snapshot-dir", str(snapshots), "--stop-at-f1", str(target_f1)],
        cwd=REPO,
        check=True,
    )
    curve = json.loads((tmp / "pretrain_info.json").read_text())["curve"]
    reached = [p for p in curve if p["f1"] >= target_f1]
    chosen = reached[0] if reached else max(curve, key=lambda p: p["f1"])
    snapshot = snapshots / f"{tmp.name}.step_{chosen['step']}.safetensors"
    if chosen["step"] != steps:
        shutil.copyfile(snapshot, tmp / "model.safetensors")
    choice = {"recipe": STAGE1_RECIPE, "step": chosen["step"], "f1": chosen["f1"], "target_f1": target_f1}
    choice["curve"] = curve
    choice["build_seconds"] = round(time.time() - t0, 1)
    (tmp / "stage1_choice.json").write_text(json.dumps(choice, indent=1) + "\n")
    shutil.rmtree(model, ignore_errors=True)
    tmp.rename(model)
    shutil.rmtree(snapshots, ignore_errors=True)
    print(f"[ab] crowded stage-1: step {chosen['step']} (held-out F1 {chosen['f1']}) in {model}", flush=True)


def build_data(task: dict[str, Any], out: Path, n_eval: int, smoke: bool) -> tuple[Path, Path]:
    """The task's train/eval JSONL (the demo generator, ``n_eval`` held-out rows)."""
    sys.path.insert(0, str(REPO))
    if task["kind"] == "tiny":
        from learner.demo_data.scenes import DemoDataConfig, write_demo_dataset

        train, held_out = write_demo_dataset(out, 64 if smoke else 4000, n_eval, 0, DemoDataConfig())
    else:
        from learner.demo_data.images import CROWDED_CONFIG, ImageDemoConfig, write_image_dataset

        cfg, n_train = (CROWDED_CONFIG, 4000) if task["kind"] == "crowded" else (ImageDemoConfig(), 6000)
        train, held_out = write_image_dataset(out, 64 if smoke else n_train, n_eval, 0, cfg)
    return Path(train), Path(held_out)


def run_learner(config: dict[str, Any], path: Path, log: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with log.open("w") as fh:
        rc = subprocess.run(
            [PY, "-m", "learner", "--config", str(path)],
            cwd=REPO,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        ).returncode
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"learner run {path} failed with exit code {rc}; log {log}:\n{tail}")


def start_server(task_config: Path, model: Path, out: Path) -> tuple[subprocess.Popen, str]:
    """The task's rollout server (its ``server:`` section) on the base checkpoint, on a free port."""
    port = free_port()
    cfg = {
        "extends": str(REPO / task_config),
        "server": {"port": port, "model": str(model), "shm_dir": SHM_DIR},
    }
    path = out / "server.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = (out / "server.log").open("w")
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.Popen(
        ["bash", str(REPO / "scripts/start_rollout_server.sh"), "--config", str(path), "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"rollout server exited with {proc.returncode}; see {out / 'server.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.terminate()
    raise SystemExit(f"rollout server on {url} not healthy after 300 s; see {out / 'server.log'}")


def stop_server(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def eval_curve(metrics: Path) -> list[dict[str, float]]:
    """Per evaluation: the step, ``f1`` (gate F1), ``pred`` (predicted objects) and every other
    ``eval_rollout_*`` figure of the breakdown (precision, recall, F1 at maskIoU 0.5 / 0.75, duplicates,
    predicted ÷ GT, …) under its name without the prefix."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
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
        for r in rows
        if "eval_rollout_f1" in r
    ]


BASE_STAMP = "base.sha256"
"""File in a run folder: the sha256 of the task's base weights the run started from."""


def base_fingerprint(task: dict[str, Any]) -> str:
    """sha256 of the task's base ``model.safetensors`` ('' when it has none): a rebuilt base (the crowded
    stage-1 is not bitwise reproducible) keeps its path, so the path alone cannot tell its runs apart."""
    weights = REPO / task["model"] / "model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else ""


def finished(run_dir: Path, cfg: dict[str, Any], total: int, base: str = "") -> bool:
    """Whether ``run_dir`` holds this run already: its last evaluation is at step ``total``, its
    ``run.yaml`` is ``cfg`` apart from where rollouts came from (the server's address and staging dir change
    from one harness invocation to the next; the runs are deterministic whichever server serves them), and it
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
        return {**config, "rollout": rollout}

    return comparable(yaml.safe_load(path.read_text())) == comparable(cfg)


BREAKDOWN = ("precision", "recall", "f1_iou50", "f1_iou75", "duplicates", "duplicate_rate", "pred_gt_ratio")
"""``eval_rollout_*`` figures whose per-arm mean over seeds the summary carries beside the gate F1."""


DEVICE_STAMP = "device.json"
"""File in a run folder: ``{"gpus": N}``, the GPUs the run held (0 on a CPU host), written once it trained."""


def run_gpus(*, colocate: bool, own_server: bool) -> int:
    """GPUs one run holds on this host: 0 without CUDA; else the learner's one, plus the rollout server's when
    this harness started it (``--server-url``'s server is another host's, not counted)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return 1 if colocate or not own_server else 2


def step_seconds(metrics: Path, after_step: int = 0) -> dict[int, float]:
    """Seconds the run spent training its steps after ``after_step``, cumulated up to each logged step: per
    training line (one with ``loss``), its ``wall_s`` minus the previous line's, so that the evaluations the
    learner logs between steps are not counted (seconds of training, not of measuring it). A run that starts
    from the base (GRPO, ``sft-canonical``) pays its first step's warm-up here; the stage-2 arms paid theirs
    in the shared base phase (on the CPU smoke ~0.8 s of 2 steps; small against real runs' steps)."""
    out: dict[int, float] = {}
    total = previous = 0.0
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
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


def t_quantile_975(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (two-sided 95 % interval)."""
    from scipy.stats import t

    return float(t.ppf(0.975, dof))


def paired_stats(diffs: Sequence[float]) -> dict[str, Any]:
    """Mean, sd, min and max of per-seed differences, and Student's t 95 % interval of the mean (two seeds or
    more: the acceptance asks for it above 0)."""
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    out: dict[str, Any] = {"mean": mean, "sd": sd, "min": min(diffs), "max": max(diffs)}
    if len(diffs) > 1:
        half = t_quantile_975(len(diffs) - 1) * sd / math.sqrt(len(diffs))
        out["ci95"] = [mean - half, mean + half]
    return out


def f1_within(curve: Sequence[dict[str, float]], budget: float) -> float:
    """F1 of the last evaluation the run reached within ``budget`` seconds of training (the base's at 0)."""
    return [p for p in curve if p["seconds"] <= budget + 1e-9][-1]["f1"]


def pair_with(
    curves: dict[tuple[str, int], list[dict[str, float]]],
    arm: str,
    control: str,
    prefix: str,
    units: dict[tuple[str, int], str] | None = None,
) -> dict[str, Any]:
    """``arm`` against ``control`` over the seeds both finished, as ``<prefix>_*`` keys of a summary line.

    By trained samples (every arm trains the same samples per step): ``<prefix>_diff``, the final F1 minus the
    control's of the same seed, and its :func:`paired_stats`. By seconds (when every run's evaluations carry
    ``seconds``, in one unit per pair): both runs cut at the seconds the faster of the two trained (each at
    its last evaluation within them), ``<prefix>_at_seconds_diff`` and its stats, the budget per seed
    (``<prefix>_at_seconds_budget``) and ``<prefix>_seconds_ratio`` (the arm's seconds ÷ the control's).
    """
    seeds = sorted(s for a, s in curves if a == arm and (control, s) in curves)
    if arm == control or not seeds:
        return {}
    out: dict[str, Any] = {f"{prefix}_seeds": seeds}
    diffs = [curves[(arm, s)][-1]["f1"] - curves[(control, s)][-1]["f1"] for s in seeds]
    out[f"{prefix}_diff"] = diffs
    out |= {f"{prefix}_{k}": v for k, v in paired_stats(diffs).items()}
    units = units or {}
    timed = [
        s
        for s in seeds
        if all("seconds" in p for p in curves[(arm, s)] + curves[(control, s)])
        and units.get((arm, s)) == units.get((control, s))
        and curves[(control, s)][-1]["seconds"] > 0
    ]
    if timed:
        budgets = [min(curves[(arm, s)][-1]["seconds"], curves[(control, s)][-1]["seconds"]) for s in timed]
        at = [
            f1_within(curves[(arm, s)], b) - f1_within(curves[(control, s)], b)
            for s, b in zip(timed, budgets, strict=True)
        ]
        out[f"{prefix}_at_seconds_seeds"] = timed
        out[f"{prefix}_at_seconds_budget"] = budgets
        out[f"{prefix}_at_seconds_diff"] = at
        out |= {f"{prefix}_at_seconds_{k}": v for k, v in paired_stats(at).items()}
        out[f"{prefix}_seconds_ratio"] = [
            curves[(arm, s)][-1]["seconds"] / curves[(control, s)][-1]["seconds"] for s in timed
        ]
    return out


PAIRING_PREFIX = {"sft": "paired", CANONICAL: "canonical_paired"}
"""Summary-line key prefix of the pairing with each of :data:`CONTROLS`."""


def summarize(
    task: str,
    curves: dict[tuple[str, int], list[dict[str, float]]],
    samples: dict[tuple[str, int], int] | None = None,
    units: dict[tuple[str, int], str] | None = None,
    orders: dict[tuple[str, int], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One line per arm: final F1 mean/sd over seeds, the breakdown's means, trained samples and training
    seconds per run (the arm's steps, evaluations excluded; ``seconds_unit`` per run: ``gpu`` GPU-seconds,
    ``cpu`` wall seconds of a CPU host), and the pairing with each of :data:`CONTROLS` the arm is not
    (:func:`pair_with`: ``paired_*`` against ``sft``, ``canonical_paired_*`` against ``sft-canonical``). The
    ``sft-canonical`` line also carries the base order measured per seed (``base_order``; ``orders``)."""
    arms = sorted({a for a, _ in curves})
    lines = []
    for arm in arms:
        seeds = sorted(s for a, s in curves if a == arm)
        finals = [curves[(arm, s)][-1]["f1"] for s in seeds]
        line: dict[str, Any] = {
            "task": task,
            "arm": arm,
            "seeds": seeds,
            "final_f1": finals,
            "mean": statistics.fmean(finals),
            "sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_pred_objects": [curves[(arm, s)][-1]["pred"] for s in seeds],
            "start_f1": statistics.fmean(curves[(arm, s)][0]["f1"] for s in seeds),
        }
        for key in BREAKDOWN:
            values = [curves[(arm, s)][-1][key] for s in seeds if key in curves[(arm, s)][-1]]
            if values:
                line[f"mean_{key}"] = statistics.fmean(values)
        if all("seconds" in curves[(arm, s)][-1] for s in seeds):
            line["train_seconds"] = [curves[(arm, s)][-1]["seconds"] for s in seeds]
            line["seconds_unit"] = [(units or {}).get((arm, s), "wall") for s in seeds]
        if samples:
            line["trained_samples"] = [samples.get((arm, s)) for s in seeds]
        if orders and any((arm, s) in orders for s in seeds):
            line["base_order"] = [orders.get((arm, s)) for s in seeds]
        for control in CONTROLS:
            line |= pair_with(curves, arm, control, PAIRING_PREFIX[control], units)
        lines.append(line)
    return lines


PANELS = (
    ("f1", "F1 at the matching gate"),
    ("precision", "precision (gate)"),
    ("recall", "recall (gate)"),
    ("f1_iou50", "F1 at maskIoU 0.5"),
    ("duplicates", "duplicate predictions"),
    ("pred_gt_ratio", "predicted / GT objects"),
)
"""The held-out figures ``ab.png`` plots per arm (mean line, min-max band over seeds)."""


def arm_label(line: dict[str, Any]) -> str:
    """An arm's legend entry: its name, seeds, and its paired mean final F1 against each control it is not."""
    label = f"{line['arm']} (n={len(line['seeds'])})"
    versus = [
        f"{control} {line[f'{PAIRING_PREFIX[control]}_mean']:+.3f}"
        for control in CONTROLS
        if f"{PAIRING_PREFIX[control]}_mean" in line
    ]
    return label + (f" vs {', '.join(versus)}" if versus else "")


def plot(task: str, curves: dict[tuple[str, int], list[dict[str, float]]], path: Path) -> None:
    """``ab.png``: one panel per :data:`PANELS` figure the runs logged, by step, per arm (the controls
    dashed), and the F1 by training seconds when the runs carry them; the legend pairs each arm with both
    controls (:func:`arm_label`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {line["arm"]: arm_label(line) for line in summarize(task, curves)}
    panels = [(k, t) for k, t in PANELS if any(k in p for c in curves.values() for p in c)]
    if all("seconds" in p for c in curves.values() for p in c):
        panels.append(("seconds", "F1 by training seconds (GPU-s on GPUs)"))
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        for arm in sorted({a for a, _ in curves}):
            runs = [c for (a, _), c in sorted(curves.items()) if a == arm]
            steps = [p["step"] for p in runs[0]]
            value = "f1" if key == "seconds" else key
            by_step = [[r[i][value] for r in runs if i < len(r) and value in r[i]] for i in range(len(steps))]
            xs_of = steps
            if key == "seconds":  # mean seconds of the runs at each evaluation
                xs_of = [
                    statistics.fmean(r[i]["seconds"] for r in runs if i < len(r)) for i in range(len(steps))
                ]
            kept = [(x, v) for x, v in zip(xs_of, by_step, strict=True) if v]
            if not kept:
                continue
            xs = [x for x, _ in kept]
            style = "--" if arm in CONTROLS else "-"
            ax.plot(xs, [statistics.fmean(v) for _, v in kept], style, marker="o", label=labels[arm])
            ax.fill_between(xs, [min(v) for _, v in kept], [max(v) for _, v in kept], alpha=0.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training seconds" if key == "seconds" else "step")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{task}: held-out figures, mean and min-max over seeds; controls dashed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_grpo(run_dirs: dict[tuple[str, int], Path], path: Path) -> None:
    """``grpo.png``: per GRPO run (arm, seed), the training reward, the KL to the reference and the mean
    completion length by step, from its ``metrics.jsonl``; one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (
        ("reward/total_mean", "reward (total, mean over completions)"),
        ("kl/mean", "KL to the reference"),
        ("completions/mean_length", "completion length (tokens)"),
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.4))
    colours = {arm: f"C{i}" for i, arm in enumerate(sorted({arm for arm, _ in run_dirs}))}
    for (arm, seed), run_dir in sorted(run_dirs.items()):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        for ax, (key, title) in zip(axes, keys, strict=True):
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points, strict=True), label=f"{arm} s{seed}", color=colours[arm], alpha=0.6)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("GRPO step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarize_copied_runs(
    task: str, out: Path, steps: int, at_step: int | None, arms: Sequence[str] | None = None
) -> int:
    """``--from-runs``: the summary, ``ab.png`` and ``grpo.png`` of the run folders ``<arm>-s<seed>-<steps>``
    in ``out`` as they are — runs copied back from another host (their ``run.yaml`` names that host's paths,
    so they are not checked against this invocation's config) or cut off by a time limit. ``at_step`` (the
    learner's step; a GRPO or ``sft-canonical`` arm's steps count from its base checkpoint) cuts every curve
    there and leaves out the runs that did not evaluate there, so that a comparison of equal samples covers
    every seed that got that far; ``arms`` keeps those arms only (default: every arm found). A seed's runs
    must start from one base (the same first held-out F1 in every arm), else the pairing would compare
    different bases: that is an error naming the runs. Writes ``ab.jsonl`` (``ab_at<step>.jsonl`` /
    ``ab_at<step>.png`` with ``at_step``); a run's training seconds count from its first evaluation.
    """
    curves: dict[tuple[str, int], list[dict[str, float]]] = {}
    units: dict[tuple[str, int], str] = {}
    orders: dict[tuple[str, int], dict[str, Any]] = {}
    grpo_runs: dict[tuple[str, int], Path] = {}
    for run_dir in sorted(out.glob(f"*-s*-{steps}")):
        arm, _, seed = run_dir.name.removesuffix(f"-{steps}").rpartition("-s")
        metrics = run_dir / "metrics.jsonl"
        known = arm in ARMS or arm in GRPO_ARMS or arm == CANONICAL
        if not known or not seed.isdigit() or not metrics.exists():
            continue
        if arms is not None and arm not in arms:
            continue
        curve = [p for p in eval_curve(metrics) if at_step is None or p["step"] <= at_step]
        if not curve or (at_step is not None and curve[-1]["step"] != at_step):
            print(f"[ab] {run_dir.name}: no evaluation at step {at_step}, left out", flush=True)
            continue
        # training seconds from the first evaluation (the base) on
        curves[(arm, int(seed))], units[(arm, int(seed))] = with_seconds(curve, run_dir, curve[0]["step"])
        if arm == CANONICAL and read_order(run_dir) is not None:
            ordering = yaml.safe_load((run_dir / "run.yaml").read_text())["data"]["object_ordering"]
            orders[(arm, int(seed))] = {**read_order(run_dir), "ordering": ordering}  # type: ignore[dict-item]
        if arm in GRPO_ARMS:
            grpo_runs[(arm, int(seed))] = run_dir
    if not curves:
        raise SystemExit(f"no run folders *-s<seed>-{steps} with evaluations in {out}")
    for seed in sorted({s for _, s in curves}):
        starts = {arm: c[0]["f1"] for (arm, s), c in curves.items() if s == seed}
        if len(set(starts.values())) > 1:
            raise SystemExit(
                f"seed {seed}: the runs in {out} start from different bases (first held-out F1 by arm: "
                f"{starts}); pass --arms of one base, or move the other runs out of the folder"
            )
    suffix = "" if at_step is None else f"_at{at_step}"
    with (out / f"ab{suffix}.jsonl").open("w") as fh:
        for (arm, seed), curve in sorted(curves.items()):
            for point in curve:
                fh.write(json.dumps({"task": task, "arm": arm, "seed": seed, **point}) + "\n")
        for line in summarize(task, curves, units=units, orders=orders):
            fh.write(json.dumps({"summary": True, **line}) + "\n")
            print(json.dumps(line), flush=True)
    plot(task, curves, out / f"ab{suffix}.png")
    if grpo_runs:
        plot_grpo(grpo_runs, out / "grpo.png")
    print(f"[ab] {out / f'ab{suffix}.jsonl'} and {out / f'ab{suffix}.png'}", flush=True)
    return 0


def grpo_override(arm: str) -> dict[str, Any]:
    """The ``grpo`` section override of GRPO arm ``arm`` (its ``learning_rate`` goes to ``training``)."""
    return {k: v for k, v in GRPO_ARMS[arm].items() if k != "learning_rate"}


def grpo_run_config(
    task_config: Path,
    common: dict[str, Any],
    *,
    grpo: dict[str, Any],
    model: str,
    run_dir: Path,
    seed: int,
    steps: int,
    eval_every: int,
    learning_rate: float,
) -> dict[str, Any]:
    """The YAML of a GRPO arm from ``model``: the task config with the harness's data and batch (``common``)
    turned into a GRPO run by `learner.grpo.config.grpo_config_from_sft` (``GRPO_GENERATIONS`` per prompt,
    the task's samples per step), evaluated first at its start (the base checkpoint's F1: the other arms' at
    the base step), with the harness's steps, seed, evaluation period and constant ``learning_rate``.

    Raises:
        SystemExit: the task's samples per step are not a multiple of ``GRPO_GENERATIONS``.
    """
    from learner.yaml_loader import load_yaml_with_extends

    sft = deep_merge(load_yaml_with_extends(task_config), {k: v for k, v in common.items() if k != "extends"})
    try:
        cfg = grpo_config_from_sft(sft, model=model, num_generations=GRPO_GENERATIONS, grpo=grpo)
    except ConfigError as exc:
        raise SystemExit(f"GRPO arm: {exc}") from exc
    training = {"max_steps": steps, "seed": seed, "eval_strategy": "steps", "eval_steps": eval_every}
    return deep_merge(
        cfg,
        {
            "output_dir": str(run_dir),
            "training": {**training, "learning_rate": learning_rate},
            "stage2": {"eval": {"at_start": True}},
            "save_final_model": False,
        },
    )


ORDER_DIR = "base_order"
"""Folder of an ``sft-canonical`` run holding the base's order measurement (`python -m learner.evaluate`'s
``metrics.json``, ``predictions.jsonl``)."""


def read_order(run_dir: Path) -> dict[str, Any] | None:
    """The ``object_order`` (`learner.evaluate.order`) measured for the run in ``run_dir`` (None: not yet)."""
    path = run_dir / ORDER_DIR / "metrics.json"
    return json.loads(path.read_text()).get("object_order") if path.exists() else None


def canonical_ordering(order: dict[str, Any] | None, task_ordering: str) -> str:
    """The ``data.object_ordering`` of the ``sft-canonical`` run: the one listing the annotations in the order
    the base follows (:data:`ORDERING_OF`); the task's own when it follows ``listed``, none (below the
    agreement threshold) or was not measured."""
    follows = (order or {}).get("follows")
    return ORDERING_OF.get(follows, task_ordering) if follows else task_ordering


def measure_base_order(
    common: dict[str, Any], *, model: str, train: Path, run_dir: Path, seed: int, n_items: int
) -> dict[str, Any]:
    """The order ``model`` (the seed's base) emits objects in, on its greedy rollouts of the first ``n_items``
    training rows, listed as the learner lists them (the task's ``data.object_ordering`` and ``seed``):
    `python -m learner.evaluate` on a colocated HF engine with the task's evaluation decoding writes
    ``run_dir/base_order``; returns its ``object_order``.

    Raises:
        SystemExit: the evaluation failed (its log's tail).
    """
    cfg = deep_merge(
        common,
        {
            "training": {"seed": seed},
            "rollout": {
                "mode": "colocate",
                "backend": "hf",
                "async": {"enabled": False},
                "decoding": {"rollout_generate_batch_size": 16},
            },
        },
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    path, log = run_dir / "base_order.yaml", run_dir / "base_order.log"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    command = [PY, "-m", "learner.evaluate", "--config", str(path), "--model", model, "--data", str(train)]
    command += ["--limit", str(n_items), "--out", str(run_dir / ORDER_DIR), "--no-coco", "--gallery", "0"]
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    with log.open("w") as fh:
        rc = subprocess.run(command, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    order = read_order(run_dir)
    if rc != 0 or order is None:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"measuring the base's order failed with exit code {rc}; log {log}:\n{tail}")
    return order


def canonical_run_config(
    common: dict[str, Any],
    rollout: dict[str, Any],
    *,
    model: str | None,
    ordering: str,
    run_dir: Path,
    seed: int,
    steps: int,
    eval_every: int,
    learning_rate: float | None,
) -> dict[str, Any]:
    """The YAML of the ``sft-canonical`` run: plain GT for ``steps`` steps in ``ordering``, from ``model``
    (the sft run's checkpoint at the base steps; None: the task's model), evaluated first at its start (the
    base, as the GRPO arms are); from a checkpoint with a fresh optimizer and schedule, as the GRPO arms."""
    training: dict[str, Any] = {"max_steps": steps, "seed": seed, "eval_strategy": "steps"}
    training["eval_steps"] = eval_every
    if learning_rate is not None:
        training["learning_rate"] = learning_rate
    cfg = deep_merge(
        common,
        {
            "output_dir": str(run_dir),
            "data": {"object_ordering": ordering},
            "rollout": rollout,
            "training": training,
            "stage2": {"sft_warmup_steps": steps, "eval": {"at_start": True}},
            "save_final_model": False,
        },
    )
    return deep_merge(cfg, {"model": {"path": model}}) if model is not None else cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="text-random")
    parser.add_argument("--arms", default=None, help="default sft,rm-keep,rm-drop (--smoke: sft,rm-reorder)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--base-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-samples", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=None, help="constant; default: the config's")
    parser.add_argument("--grpo-learning-rate", type=float, default=1e-4, help="GRPO arms (constant)")
    parser.add_argument("--out", type=Path, default=None, help="default runs/ab/<task>")
    parser.add_argument("--server-url", default=None, help="use this running server instead of starting one")
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="roll out in-process (HF engine) instead of a server: GPU machines",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny run for CI: 2 steps, 8 eval rows")
    parser.add_argument(
        "--order-samples",
        type=int,
        default=64,
        help=f"{CANONICAL}: training rows the base's object order is measured on (its greedy rollouts)",
    )
    parser.add_argument("--stage1-steps", type=int, default=1400, help="crowded tasks: stage-1 steps")
    parser.add_argument("--stage1-every", type=int, default=200, help="crowded: stage-1 eval/snapshot period")
    parser.add_argument(
        "--stage1-eval-from", type=int, default=0, help="crowded: first stage-1 step evaluated (saves time)"
    )
    parser.add_argument("--stage1-target-f1", type=float, default=0.5, help="crowded: the base's F1")
    parser.add_argument("--stage1-device", default="cuda", help="crowded: where stage-1 trains")
    parser.add_argument(
        "--summarize-only",
        action="store_true",
        help="train nothing: summarize the runs that finished (e.g. after parallel runs were cut off)",
    )
    parser.add_argument(
        "--prepare-only", action="store_true", help="build the data and the base model, then stop"
    )
    parser.add_argument(
        "--from-runs",
        action="store_true",
        help="train and build nothing: summarize the run folders in --out as they are (e.g. copied back)",
    )
    parser.add_argument(
        "--at-step",
        type=int,
        default=None,
        help="with --from-runs: compare the arms at this step (runs without an evaluation there left out)",
    )
    args = parser.parse_args(argv)
    if args.at_step is not None and not args.from_runs:
        parser.error("--at-step goes with --from-runs")
    if args.from_runs:
        out = (args.out or REPO / "runs" / "ab" / args.task).resolve()
        arms = args.arms.split(",") if args.arms else None
        return summarize_copied_runs(args.task, out, args.steps, args.at_step, arms)
    if args.smoke:
        args.seeds, args.base_steps, args.steps = "0", 2, 2
        args.eval_every, args.eval_samples = 2, 8
        args.arms = args.arms or "sft,rm-reorder"
    args.arms = args.arms or "sft,rm-keep,rm-drop"
    unknown = sorted(set(args.arms.split(",")) - set(ARMS) - set(GRPO_ARMS) - {CANONICAL})
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; known: {sorted([*ARMS, *GRPO_ARMS, CANONICAL])}")
    if args.order_samples < 1:
        parser.error(f"--order-samples {args.order_samples} must be >= 1")
    arms = args.arms.split(",")
    grpo_arms = [a for a in arms if a in GRPO_ARMS]
    if grpo_arms and not args.colocate:
        parser.error(
            f"{grpo_arms} run with --colocate only (GRPO rolls out with its own HF engine in-process)"
        )
    from_base = [a for a in arms if a in GRPO_ARMS or a == CANONICAL]  # start from the seed's base checkpoint
    if from_base and args.base_steps > 0:  # the sft run is their base checkpoint: it runs first
        arms = ["sft", *[a for a in arms if a != "sft"]]
    task = TASKS[args.task]
    out = (args.out or REPO / "runs" / "ab" / args.task).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = build_data(task, out / "data", args.eval_samples, args.smoke)
    stage1 = {"steps": args.stage1_steps, "every": args.stage1_every, "target_f1": args.stage1_target_f1}
    stage1 |= {"device": args.stage1_device, "eval_from": args.stage1_eval_from}
    if args.smoke:  # a throw-away stage-1 of its own, never the cached real one
        stage1 |= {"n_eval": 2, "max_new_tokens": 32, "batch": 2}
        task = {**task, "model": task["model"] + "-smoke"}
    build_model(task, out / "data", stage1)
    if args.prepare_only:
        return 0
    base_sha = base_fingerprint(task)
    task_config = REPO / task["config"]
    batch = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1} if args.smoke else {}
    smoke_decoding = {"decoding": {"max_new_tokens": 48}} if args.smoke else {}
    common = {
        "extends": str(task_config),
        "data": {
            "train": [str(train)],
            "eval": [str(held_out)],
            "object_ordering": task["ordering"],
            "max_eval_samples": args.eval_samples,
        },
        "training": {"report_to": [], **batch},
        "rollout": smoke_decoding,
    }
    if task["kind"] == "crowded":  # the stage-1 built above
        common["model"] = {"path": str(REPO / task["model"])}

    server = None
    url = args.server_url
    if url is None and not args.colocate:
        server, url = start_server(task_config, Path(task["model"]), out)
    rollout = (
        # every row of a step in one decode call (the spec's default of 1 decodes them one at a time)
        {"mode": "colocate", "backend": "hf", "decoding": {"rollout_generate_batch_size": 16}}
        if args.colocate
        else {"servers": [{"base_url": url}], "sync": {"shm_dir": SHM_DIR}}
        if server is not None
        else {"servers": [{"base_url": url}], "sync": {"transport": "http"}}  # another host's staging dir
    )
    curves: dict[tuple[str, int], list[dict[str, float]]] = {}
    units: dict[tuple[str, int], str] = {}
    samples: dict[tuple[str, int], int] = {}
    orders: dict[tuple[str, int], dict[str, Any]] = {}
    gpus = run_gpus(colocate=args.colocate, own_server=server is not None)
    results = out / "ab.jsonl"
    try:
        with results.open("a") as fh:
            for seed in [int(s) for s in args.seeds.split(",")]:
                # the seed's base: the sft run's weights at the base steps (saved for them), else the task's
                base_dir = out / f"sft-s{seed}-{args.steps}" / f"checkpoint-{args.base_steps}"
                base = str(base_dir) if args.base_steps > 0 else None
                for arm in arms:
                    run_dir = out / f"{arm}-s{seed}-{args.steps}"
                    metrics = run_dir / "metrics.jsonl"
                    # a run from the base counts its own steps; the curve is shifted onto the others' steps
                    own_steps = arm in GRPO_ARMS or arm == CANONICAL
                    total = args.steps if own_steps else args.base_steps + args.steps
                    if arm in GRPO_ARMS:
                        cfg = grpo_run_config(
                            task_config,
                            common,
                            grpo=grpo_override(arm),
                            model=base or base_model(task_config, common),
                            run_dir=run_dir,
                            seed=seed,
                            steps=args.steps,
                            eval_every=args.eval_every,
                            learning_rate=GRPO_ARMS[arm].get("learning_rate", args.grpo_learning_rate),
                        )
                    elif arm == CANONICAL:
                        canonical = {"model": base, "run_dir": run_dir, "seed": seed, "steps": args.steps}
                        canonical |= {"eval_every": args.eval_every, "learning_rate": args.learning_rate}
                        ordering = canonical_ordering(read_order(run_dir), task["ordering"])
                        cfg = canonical_run_config(common, rollout, ordering=ordering, **canonical)
                    else:
                        training = {"max_steps": total, "seed": seed, "eval_strategy": "steps"}
                        training["eval_steps"] = args.eval_every
                        if args.learning_rate is not None:
                            training["learning_rate"] = args.learning_rate
                        # the base's F1 once it is the stage-1 itself (no shared plain-GT phase)
                        stage2 = deep_merge(ARMS[arm], {"eval": {"at_start": args.base_steps == 0}})
                        # every arm: plain GT for the base steps (the same run for a seed), then its recipe
                        stage2["sft_warmup_steps"] = total if arm == "sft" else args.base_steps
                        if arm == "sft" and from_base and args.base_steps > 0:  # their base checkpoint
                            training |= {"save_strategy": "steps", "save_steps": args.base_steps}
                            training["save_only_model"] = True
                        cfg = deep_merge(
                            common,
                            {
                                "output_dir": str(run_dir),
                                "rollout": rollout,
                                "training": training,
                                "stage2": stage2,
                                "save_final_model": False,
                            },
                        )
                    if not finished(run_dir, cfg, total, base_sha) or (
                        arm == CANONICAL and read_order(run_dir) is None
                    ):
                        if args.summarize_only:
                            print(f"[ab] {run_dir.name}: not finished, left out", flush=True)
                            continue
                        t0 = time.time()
                        metrics.unlink(missing_ok=True)
                        if arm == CANONICAL:
                            order = measure_base_order(
                                common,
                                model=base or base_model(task_config, common),
                                train=train,
                                run_dir=run_dir,
                                seed=seed,
                                n_items=args.order_samples,
                            )
                            print(
                                f"[ab] {args.task} seed {seed}: the base's order {json.dumps(order)}",
                                flush=True,
                            )
                            ordering = canonical_ordering(order, task["ordering"])
                            cfg = canonical_run_config(common, rollout, ordering=ordering, **canonical)
                        run_learner(cfg, run_dir / "run.yaml", run_dir / "learner.log")
                        (run_dir / BASE_STAMP).write_text(base_sha + "\n")
                        (run_dir / DEVICE_STAMP).write_text(json.dumps({"gpus": gpus}) + "\n")
                        print(f"[ab] {args.task} {arm} seed {seed}: {time.time() - t0:.0f} s", flush=True)
                    if own_steps:
                        curve, units[(arm, seed)] = with_seconds(eval_curve(metrics), run_dir)
                        curve = [{**p, "step": p["step"] + args.base_steps} for p in curve]
                    else:
                        curve = [p for p in eval_curve(metrics) if p["step"] >= args.base_steps]
                        curve, units[(arm, seed)] = with_seconds(curve, run_dir, args.base_steps)
                    if arm == CANONICAL:  # the order measured and the annotation order it trained on
                        orders[(arm, seed)] = {
                            **(read_order(run_dir) or {}),
                            "ordering": cfg["data"]["object_ordering"],
                        }
                    samples[(arm, seed)] = args.steps * samples_per_step(cfg)
                    curves[(arm, seed)] = curve
                    for point in curve:
                        fh.write(json.dumps({"task": args.task, "arm": arm, "seed": seed, **point}) + "\n")
                        fh.flush()
            summary = summarize(args.task, curves, samples, units, orders)
            for line in summary:
                fh.write(json.dumps({"summary": True, **line}) + "\n")
                print(json.dumps(line), flush=True)
    finally:
        if server is not None:
            stop_server(server)
    plot(args.task, curves, out / "ab.png")
    grpo_runs = {(arm, seed): out / f"{arm}-s{seed}-{args.steps}" for arm, seed in curves if arm in GRPO_ARMS}
    if grpo_runs:
        plot_grpo(grpo_runs, out / "grpo.png")
    print(f"[ab] {results} and {out / 'ab.png'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What every run of a task starts from: its train / held-out data, its base model (the demo's, or the crowded
stage-1 trained here) and that base's fingerprint."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _ab.tables import PY, REPO


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


def base_fingerprint(task: dict[str, Any]) -> str:
    """sha256 of the task's base ``model.safetensors`` ('' when it has none): a rebuilt base (the crowded
    stage-1 is not bitwise reproducible) keeps its path, so the path alone cannot tell its runs apart."""
    weights = REPO / task["model"] / "model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else ""

"""`bench/ab_learning.py --smoke` on the session's real vLLM server: two arms (plain SFT and rollout-matching
`reorder`), one seed, 2 + 2 steps, 8 held-out rows. Checks the harness's contract, not learning: both arms
share the base phase (identical F1 at the base step), the jsonl holds every evaluation and a paired summary,
the PNG is written, and the rollout-matching arm really rolled out (its metrics carry rollout counters, the
SFT arm's do not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from learner.report import load_metrics
from tests.integration.test_learner_loop import restores_seed0  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def run_smoke(tmp_path: Path, arm: str, *flags: str) -> tuple[list[dict], dict[str, dict]]:
    """Runs the harness's smoke with `flags` into `tmp_path`; returns its evaluation lines and the summary per
    arm, after the checks every smoke must pass: sft and `arm` evaluated at the base step and the last one,
    with the same F1 at the base step (one base per seed)."""
    result = subprocess.run(
        [sys.executable, "bench/ab_learning.py", "--smoke", *flags, "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "ab.jsonl").read_text().splitlines()]
    points = [line for line in lines if "summary" not in line]
    assert {(p["arm"], p["step"]) for p in points} == {(a, s) for a in ("sft", arm) for s in (2, 4)}
    base = {p["arm"]: p["f1"] for p in points if p["step"] == 2}
    assert base["sft"] == base[arm]  # the same base for both arms of a seed, evaluated by the same evaluator
    return points, {line["arm"]: line for line in lines if line.get("summary")}


def final_diff(points: list[dict], arm: str, step: int = 4) -> float:
    """`arm`'s F1 minus sft's at `step` (the smoke's last step), from the jsonl's evaluation lines."""
    f1 = {p["arm"]: p["f1"] for p in points if p["step"] == step}
    return f1[arm] - f1["sft"]


@pytest.mark.usefixtures("restores_seed0")
def test_ab_smoke_runs_both_arms_from_one_base_and_summarizes_them(vllm_server, tmp_path: Path) -> None:
    points, summary = run_smoke(tmp_path, "rm-reorder", "--server-url", vllm_server.base_url)
    assert set(summary) == {"sft", "rm-reorder"}
    assert summary["rm-reorder"]["paired_diff"] == [final_diff(points, "rm-reorder")]
    assert (tmp_path / "ab.png").stat().st_size > 0

    def rolled_out(arm: str) -> float:
        rows = load_metrics(tmp_path / f"{arm}-s0-2" / "metrics.jsonl")
        return sum(r.get("rollout/samples", 0.0) for r in rows if "loss" in r)

    assert rolled_out("rm-reorder") == 8.0 and rolled_out("sft") == 0.0  # 2 rollout steps x 4 samples


def test_ab_smoke_grpo_arm_starts_from_the_sft_base_and_is_paired(tmp_path: Path) -> None:
    """`--colocate --arms sft,grpo-detection --smoke` on the image task (no server: HF engine in-process): the
    GRPO arm starts from the sft run's checkpoint at the base step (same F1 there, same evaluator), its
    evaluations are shifted onto the other arms' steps, it trained as many samples (1 prompt x 4 completions
    per step = the sft batch of 4) and the summary pairs it with sft."""
    points, summary = run_smoke(tmp_path, "grpo-detection", "--task", "image-random", "--colocate", "--arms",
                                "sft,grpo-detection")  # fmt: skip
    assert summary["grpo-detection"]["trained_samples"] == summary["sft"]["trained_samples"] == [8]
    assert summary["grpo-detection"]["paired_diff"] == [final_diff(points, "grpo-detection")]
    grpo = yaml.safe_load((tmp_path / "grpo-detection-s0-2" / "run.yaml").read_text())
    assert grpo["model"]["path"] == str(tmp_path / "sft-s0-2" / "checkpoint-2")
    steps = [r for r in load_metrics(tmp_path / "grpo-detection-s0-2" / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2 and all("reward/detection.f1/mean" in r and "kl/mean" in r for r in steps)

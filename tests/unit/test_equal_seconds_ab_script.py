"""bench/equal_seconds_ab_gpu.sh's flow, with a stand-in for the harness that records its command lines:
every on-policy arm has a folder with its own sft run and control, the pricing seed runs each folder first
and alone, each other seed's GRPO arm and control start after that seed's sft run (they resume its base
checkpoint), and the summaries read every run at the pricing seed's prices before one sweep sets the arms
side by side."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CANONICAL = "sft-canonical"

RECORDER = """#!/usr/bin/env bash
# stands in for python3: one line per harness invocation (its arguments), the pricing stamp where asked
echo "$*" >> "$CALLS"
out=$(echo "$*" | sed -n 's/.*--out \\([^ ]*\\).*/\\1/p')
case "$*" in
  *--from-runs*) echo "[ab] summary" ;;
  *) mkdir -p "$out"; echo '{"seed": 0}' > "$out/step_prices.json"; sleep 0.05 ;;
esac
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "fake_python"
    fake.write_text(RECORDER)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    paths = {"PY": str(fake), "CALLS": str(tmp_path / "calls.txt"), "OUT": str(tmp_path / "ab")}
    return subprocess.run(
        ["bash", str(REPO / "bench" / "equal_seconds_ab_gpu.sh")],
        env={**os.environ, **paths, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _calls(tmp_path: Path, **env: str) -> list[str]:
    proc = _run(tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / "calls.txt").read_text().splitlines()


def _arg(call: str, flag: str) -> str:
    words = call.split()
    return words[words.index(flag) + 1]


def _folder(call: str) -> str:
    return Path(_arg(call, "--out")).name


def test_each_arm_has_its_own_folder_priced_first_and_its_chains_wait_for_sft(tmp_path: Path) -> None:
    calls = _calls(tmp_path, SEEDS="3,5,6", ARMS="rm-reorder,grpo-detection-iou50")
    pricing, side, summaries, sweep = calls[:2], calls[2:-3], calls[-3:-1], calls[-1]
    for call, arm in zip(pricing, ("rm-reorder", "grpo-detection-iou50"), strict=True):
        assert _arg(call, "--seeds") == "3" and _arg(call, "--price-seed") == "3"
        assert _arg(call, "--arms") == f"sft,{arm},{CANONICAL}" and _folder(call) == arm
        assert "--vllm-gpu-memory" not in call  # alone: the one-GPU split
    for call, arm in zip(summaries, ("rm-reorder", "grpo-detection-iou50"), strict=True):
        assert "--from-runs" in call and _arg(call, "--price-seed") == "3" and _folder(call) == arm
    assert "ab_sweep.py" in sweep
    assert "--summary rm-reorder=" in sweep and "--summary grpo-detection-iou50=" in sweep
    assert all("--vllm-gpu-memory" in c and _arg(c, "--price-seed") == "3" for c in side)
    for seed in ("5", "6"):
        for arm in ("rm-reorder", "grpo-detection-iou50"):
            mine = [_arg(c, "--arms") for c in side if _arg(c, "--seeds") == seed and _folder(c) == arm]
            assert sorted(mine) == sorted(["sft", arm, CANONICAL])  # the control is the arm's own
            assert mine.index("sft") < mine.index(CANONICAL)
        grpo = [_arg(c, "--arms") for c in side if _arg(c, "--seeds") == seed and _folder(c) != "rm-reorder"]
        assert grpo.index("sft") < grpo.index("grpo-detection-iou50")  # it resumes the base checkpoint
    assert not [c for c in side if _arg(c, "--seeds") == "3"]


def test_the_backend_and_lengths_reach_every_run(tmp_path: Path) -> None:
    calls = _calls(tmp_path, SEEDS="0,1", ARMS="rm-reorder", BACKEND="hf", GRPO_BACKEND="vllm", STEPS="30")
    for call in calls[:-2]:
        assert _arg(call, "--colocate-backend") == "hf" and _arg(call, "--grpo-colocate-backend") == "vllm"
        assert _arg(call, "--base-steps") == "150" and _arg(call, "--steps") == "30"
    assert _arg(calls[-2], "--steps") == "30"


def test_the_default_arms_and_the_controls_named_in_arms(tmp_path: Path) -> None:
    """sft and sft-canonical in ARMS are the controls every folder runs anyway, not arms of their own;
    rm-reorder-m2 reuses rollouts, so it resumes the sft run's base checkpoint: in the chain after sft."""
    calls = _calls(tmp_path, SEEDS="0,1")
    pricing = [_arg(c, "--arms") for c in calls[:3]]
    arms = ("rm-reorder", "rm-reorder-m2", "grpo-detection-iou50")
    assert pricing == [f"sft,{a},{CANONICAL}" for a in arms]
    mine = [_arg(c, "--arms") for c in calls[3:-4] if _folder(c) == "rm-reorder-m2"]
    assert mine.index("sft") < mine.index("rm-reorder-m2")
    (tmp_path / "named").mkdir()
    named = _calls(tmp_path / "named", SEEDS="0", ARMS="sft,rm-reorder,sft-canonical")
    assert _arg(named[0], "--arms") == f"sft,rm-reorder,{CANONICAL}" and len(named) == 3


def test_arms_without_an_on_policy_arm_are_refused(tmp_path: Path) -> None:
    proc = _run(tmp_path, ARMS="sft")
    assert proc.returncode == 2 and "names no on-policy arm" in proc.stderr

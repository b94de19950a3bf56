"""bench/equal_seconds_ab_gpu.sh's flow, with a stand-in for the harness that records its command lines:
the pricing seed runs every arm first and alone, each other seed's GRPO and control start after that seed's
sft run (they resume its base checkpoint), and the summary reads every run at the pricing seed's prices."""

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


def _calls(tmp_path: Path, **env: str) -> list[str]:
    fake = tmp_path / "fake_python"
    fake.write_text(RECORDER)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls.txt"
    full_env = {**os.environ, "PY": str(fake), "CALLS": str(calls), "OUT": str(tmp_path / "ab"), **env}
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "equal_seconds_ab_gpu.sh")],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return calls.read_text().splitlines()


def _arg(call: str, flag: str) -> str:
    words = call.split()
    return words[words.index(flag) + 1]


def test_the_pricing_seed_runs_every_arm_first_and_the_chains_wait_for_sft(tmp_path: Path) -> None:
    calls = _calls(tmp_path, SEEDS="3,5,6", ARMS="rm-reorder,grpo-detection-iou50")
    first = calls[0]
    assert _arg(first, "--seeds") == "3" and _arg(first, "--price-seed") == "3"
    assert _arg(first, "--arms") == "sft,rm-reorder,grpo-detection-iou50,sft-canonical"
    assert "--vllm-gpu-memory" not in first  # alone: the one-GPU split
    assert "--from-runs" in calls[-1] and _arg(calls[-1], "--price-seed") == "3"
    side = calls[1:-1]
    assert all("--vllm-gpu-memory" in c and _arg(c, "--price-seed") == "3" for c in side)
    for seed in ("5", "6"):
        mine = [_arg(c, "--arms") for c in side if _arg(c, "--seeds") == seed]
        assert sorted(mine) == sorted(["sft", "rm-reorder", "grpo-detection-iou50", "sft-canonical"])
        assert mine.index("sft") < mine.index("grpo-detection-iou50")
        assert mine.index("sft") < mine.index("sft-canonical")
    assert not [c for c in side if _arg(c, "--seeds") == "3"]


def test_the_backend_and_lengths_reach_every_run(tmp_path: Path) -> None:
    calls = _calls(tmp_path, SEEDS="0,1", ARMS="rm-reorder", BACKEND="hf", GRPO_BACKEND="vllm", STEPS="30")
    for call in calls[:-1]:
        assert _arg(call, "--colocate-backend") == "hf" and _arg(call, "--grpo-colocate-backend") == "vllm"
        assert _arg(call, "--base-steps") == "150" and _arg(call, "--steps") == "30"
    assert _arg(calls[-1], "--steps") == "30"


def test_the_arms_that_resume_the_base_wait_for_sft_and_the_default_arms_have_one(tmp_path: Path) -> None:
    """rm-reorder-m4 reuses rollouts, so it resumes the sft run's base checkpoint: in the chain after sft."""
    calls = _calls(tmp_path, SEEDS="0,1")
    assert _arg(calls[0], "--arms") == "sft,rm-reorder,rm-reorder-m4,grpo-detection-iou50,sft-canonical"
    mine = [_arg(c, "--arms") for c in calls[1:-1]]
    assert sorted(mine) == sorted(["sft", "rm-reorder", "rm-reorder-m4", "grpo-detection-iou50", CANONICAL])
    assert mine.index("sft") < mine.index("rm-reorder-m4")

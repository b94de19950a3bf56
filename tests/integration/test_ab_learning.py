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

from tests.integration.test_learner_loop import restores_seed0  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("restores_seed0")
def test_ab_smoke_runs_both_arms_from_one_base_and_summarizes_them(vllm_server, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "bench/ab_learning.py", "--smoke", "--server-url", vllm_server.base_url, "--out",
         str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "ab.jsonl").read_text().splitlines()]
    points = [line for line in lines if "summary" not in line]
    assert {(p["arm"], p["step"]) for p in points} == {(a, s) for a in ("sft", "rm-reorder") for s in (2, 4)}
    base = {p["arm"]: p["f1"] for p in points if p["step"] == 2}
    assert base["sft"] == base["rm-reorder"]  # the same base phase for both arms of a seed
    summary = {line["arm"]: line for line in lines if line.get("summary")}
    assert set(summary) == {"sft", "rm-reorder"}
    assert summary["rm-reorder"]["paired_diff"] == [
        next(p["f1"] for p in points if p["arm"] == "rm-reorder" and p["step"] == 4)
        - next(p["f1"] for p in points if p["arm"] == "sft" and p["step"] == 4)
    ]
    assert (tmp_path / "ab.png").stat().st_size > 0

    def rolled_out(arm: str) -> float:
        rows = [json.loads(x) for x in (tmp_path / f"{arm}-s0-2" / "metrics.jsonl").read_text().splitlines()]
        return sum(r.get("rollout/samples", 0.0) for r in rows if "loss" in r)

    assert rolled_out("rm-reorder") == 8.0 and rolled_out("sft") == 0.0  # 2 rollout steps x 4 samples

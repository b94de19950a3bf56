"""bench/ab_sweep.py: the arms of several A/B summaries against sft-canonical at equal seconds, by price."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ab_sweep  # noqa: E402


def _arm_line(arm: str, f1: list[float], ratio: list[float]) -> dict:
    mean = sum(f1) / len(f1)
    return {
        "arm": arm,
        "seeds": [0, 1, 2],
        "paired_seconds_ratio": ratio,
        "canonical_paired_at_seconds_seeds": [0, 2],  # seed 1's control stopped short: not paired
        "canonical_paired_at_seconds_f1": {"diff": f1, "mean": mean, "ci95": [mean - 0.1, mean + 0.1]},
        "canonical_paired_at_seconds_precision": {"diff": [0.1, 0.3], "mean": 0.2},
        "canonical_paired_at_seconds_duplicates": {"diff": [-10, -30], "mean": -20},
    }


def _write(path: Path, *lines: dict) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_rows_take_each_arms_last_line_once_with_the_paired_seeds_prices(tmp_path: Path) -> None:
    sft = {"arm": "sft", "seeds": [0, 1, 2], "canonical_paired_at_seconds_f1": {"diff": [0.0], "mean": 0.0}}
    first = _write(
        tmp_path / "a.jsonl",
        _arm_line("rm-reorder-m4", [9.0, 9.0], [1.0, 1.0, 1.0]),  # an earlier summary: superseded
        _arm_line("rm-reorder-m4", [0.04, -0.02], [1.8, 1.9, 1.7]),
        sft,
        {"arm": "sft-canonical", "seeds": [0, 1, 2]},
    )
    # a later A/B into the same folder summarizes m4 again: it counts once, from the first summary
    second = _write(
        tmp_path / "b.jsonl",
        _arm_line("rm-reorder-m4", [0.5, 0.5], [1.8, 1.9, 1.7]),
        _arm_line("rm-reorder-m8", [0.01, 0.03], [1.4, 1.5, 1.6]),
    )
    rows = ab_sweep.sweep_rows({"m4": first, "m8": second})
    assert [(r["label"], r["arm"]) for r in rows] == [("m4", "rm-reorder-m4"), ("m8", "rm-reorder-m8")]
    assert rows[0]["price"] == [1.8, 1.7] and rows[0]["f1_diff"] == [0.04, -0.02] and rows[0]["ahead"] == 1
    assert rows[1]["f1_mean"] == pytest.approx(0.02) and rows[1]["duplicates_mean"] == -20
    assert [r["arm"] for r in ab_sweep.sweep_rows({"m4": first, "m8": second}, ["rm-reorder-m8"])] == [
        "rm-reorder-m8"
    ]
    # sft timed only seeds 0 and 2 (seed 1's sft run was cut off): the ratios run over those
    untimed = _arm_line("rm-reorder-m2", [0.1, 0.2], [2.5, 2.7])
    untimed |= {"paired_at_seconds_seeds": [2], "paired_at_seconds_missing": [0]}
    row = ab_sweep.sweep_rows({"m2": _write(tmp_path / "c.jsonl", untimed)})[0]
    assert row["price"] == [2.5, 2.7]
    table = ab_sweep.markdown(rows)
    assert "| m8 | `rm-reorder-m8` | 1.40–1.60 × | +0.020 [-0.080, +0.120] | 2 of 2 | +0.020 |" in table


def test_a_summary_without_a_control_pairing_is_refused_naming_the_fix(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl", {"arm": "sft", "seeds": [0]}, {"arm": "rm-reorder", "seeds": [0]})
    with pytest.raises(ValueError, match="--summarize-only"):
        ab_sweep.sweep_rows({"x": path})


def test_the_command_writes_the_picture_and_prints_the_table(tmp_path: Path, capsys) -> None:
    path = _write(tmp_path / "a.jsonl", _arm_line("rm-reorder-m8", [0.01, 0.03], [1.4, 1.5, 1.6]))
    out = tmp_path / "sweep.png"
    ab_sweep.main(["--summary", f"m8={path}", "--out", str(out)])
    assert out.stat().st_size > 10_000 and "`rm-reorder-m8`" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ab_sweep.main(["--summary", str(path), "--out", str(out)])  # no LABEL=

"""Detection breakdown: TP at maskIoU thresholds (the matcher re-run), duplicates, rates of summed counts."""

from __future__ import annotations

import pytest

from learner.stage2.matching.breakdown import (
    detection_breakdown,
    detection_counts,
    detection_rates,
    prf,
    threshold_tag,
)
from learner.stage2.matching.match import MatchingConfig, match
from learner.stage2.pipeline import eval_metrics

CFG = MatchingConfig()
A, B = ("bbox_2d", (100, 100, 300, 300)), ("bbox_2d", (500, 500, 700, 700))


def test_thresholds_duplicates_and_best_gt():
    preds = [
        A,  # exact: IoU 1
        ("bbox_2d", (110, 100, 310, 300)),  # a second answer for A (IoU 0.905): duplicate
        ("bbox_2d", (500, 500, 690, 640)),  # B, IoU 0.665: TP at 0.5, not at 0.75
        ("bbox_2d", (800, 800, 900, 900)),  # overlaps nothing: FP, not a duplicate
    ]
    b = detection_breakdown(preds, [A, B], CFG)
    assert [(p, g) for p, g, _ in b.gate.pairs] == [(0, 0), (2, 1)]
    assert b.duplicates == (1,)
    assert b.best_gt[1][0] == 0 and b.best_gt[3] == (-1, 0.0)
    assert detection_counts(b) == {
        "matched_iou50": 2.0,
        "matched_iou75": 1.0,
        "matched_iou95": 1.0,
        "duplicates": 1.0,
    }


def test_a_poor_overlap_with_a_matched_object_is_not_a_duplicate():
    # IoU with A below the gate 0.3: a false positive, but no second answer for A
    b = detection_breakdown([A, ("bbox_2d", (250, 100, 450, 300))], [A], CFG)
    assert b.best_gt[1][0] == 0 and b.best_gt[1][1] < CFG.maskiou_gate
    assert b.duplicates == ()


def test_threshold_matching_is_a_rematch_not_a_filter_of_the_gate_pairs():
    # At the gate, Hungarian pairs p0-g0 (0.45) and p1-g1; at 0.5 the matcher may pick other pairs.
    gts = [("bbox_2d", (0, 0, 100, 100)), ("bbox_2d", (0, 0, 100, 220))]
    preds = [("bbox_2d", (0, 0, 100, 180))]
    gate = match(preds, gts, CFG)
    b = detection_breakdown(preds, gts, CFG, gate=gate)
    assert b.gate is gate
    assert len(b.at[0.5].pairs) == 1 and b.at[0.5].pairs[0][2] >= 0.5


def test_rates_of_sums():
    sums = {
        "matched": 3.0,
        "valid_pred_objects": 4.0,
        "gt_objects": 6.0,
        "matched_iou50": 2.0,
        "matched_iou75": 1.0,
        "matched_iou95": 0.0,
        "duplicates": 1.0,
        "matched_maskiou_sum": 2.4,
        "matched_maskiou_count": 3.0,
        "parse_obj_total": 5.0,
    }
    r = detection_rates(sums)
    assert (r["precision"], r["recall"]) == (0.75, 0.5)
    assert r["f1"] == pytest.approx(0.6)
    assert r["f1_iou50"] == pytest.approx(prf(2, 4, 6)[2])
    assert r["f1_iou95"] == 0.0
    assert r["duplicates"] == 1.0 and r["duplicate_rate"] == 0.25
    assert r["pred_gt_ratio"] == pytest.approx(4 / 6)
    assert r["matched_maskiou_mean"] == pytest.approx(0.8)
    assert r["parse_valid_rate"] == pytest.approx(0.8)
    assert detection_rates({})["f1"] == 0.0
    assert threshold_tag(0.5) == "iou50" and threshold_tag(0.95) == "iou95"


def test_eval_metrics_carries_the_breakdown_and_keeps_the_gate_f1():
    sums = {"matched": 1.0, "valid_pred_objects": 2.0, "gt_objects": 1.0, "matched_iou50": 1.0}
    m = eval_metrics(sums, n_samples=1, runtime_s=1.0)
    # eval_rollout_f1 is the gate F1 as before: P = 1/2, R = 1/1
    assert m["eval_rollout_f1"] == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    for key in (
        "precision",
        "recall",
        "f1_iou50",
        "f1_iou75",
        "f1_iou95",
        "precision_iou50",
        "recall_iou75",
        "duplicates",
        "duplicate_rate",
        "pred_gt_ratio",
        "matched_maskiou_mean",
        "parse_valid_rate",
    ):
        assert f"eval_rollout_{key}" in m
    assert m["eval_rollout_f1_iou50"] == m["eval_rollout_f1"]

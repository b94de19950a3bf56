"""Detection breakdown of a matched rollout: true positives at several maskIoU thresholds, duplicates, and the
rates computed from their sums (docs/ALGORITHM.md#evaluation).

One definition for every evaluator: the training loop's evaluation (`learner.stage2.pipeline.eval_metrics`,
the `eval_rollout_*` keys), `python -m learner.evaluate` and GRPO's held-out evaluation call these functions.
Pure: geometries in, numbers out.

Definitions (all on the norm1000 grid, IoU = the matcher's exact maskIoU):

- **gate matching**: the training matcher (`match`) with `stage2.matching` as configured; its pairs are the
  true positives of `precision` / `recall` / `f1` (`eval_rollout_f1`).
- **TP@t**: the same matcher re-run with `maskiou_gate = t` (t in `IOU_THRESHOLDS`): the one-to-one assignment
  among pairs with maskIoU >= t. Not a filter of the gate pairs: a prediction matched at the gate to one
  object with IoU 0.45 may match another object with IoU 0.6 at t = 0.5.
- **duplicate**: a valid prediction that the gate matching left unmatched, whose best-IoU ground-truth object
  (highest maskIoU; ties go to the lower GT index) has maskIoU >= the matching gate and is matched to another
  prediction — a second answer for an object already found. Counted among the false positives.
- **pred/GT ratio**: valid predicted objects / ground-truth objects (1.0 = as many answers as objects).

Rates of summed counts use `ratio(a, b) = a / max(b, 1)`, so an empty denominator gives 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from learner.stage2.matching.maskiou import Geom, mask_iou_pairs
from learner.stage2.matching.match import MatchingConfig, MatchResult, match

__all__ = [
    "IOU_THRESHOLDS",
    "DetectionBreakdown",
    "detection_breakdown",
    "detection_counts",
    "detection_rates",
    "prf",
    "threshold_tag",
]

IOU_THRESHOLDS: tuple[float, ...] = (0.5, 0.75, 0.95)
"""maskIoU thresholds of the `*_iou50` / `*_iou75` / `*_iou95` figures."""


def threshold_tag(t: float) -> str:
    """Key suffix of a threshold: `0.5` → `iou50`, `0.75` → `iou75`, `0.95` → `iou95`."""
    return f"iou{round(t * 100):02d}"


@dataclass(frozen=True)
class DetectionBreakdown:
    """One sample's detection figures.

    Attributes:
        gate: the training matcher's result (`stage2.matching`).
        at: matcher result per threshold of `IOU_THRESHOLDS` (re-run with that gate).
        best_gt: per valid prediction, `(gt index, maskIoU)` of its best-IoU GT object; `(-1, 0.0)` when no
            GT overlaps it (or there is no GT).
        duplicates: prediction indices counted as duplicates (see the module docstring), ascending.
        n_pred: valid predictions; n_gt: well-formed GT objects.
    """

    gate: MatchResult
    at: dict[float, MatchResult]
    best_gt: tuple[tuple[int, float], ...]
    duplicates: tuple[int, ...]
    n_pred: int
    n_gt: int


def _best_gt(preds: Sequence[Geom], gts: Sequence[Geom]) -> tuple[tuple[int, float], ...]:
    """Exact best-IoU GT of every prediction (the IoU matrix with gate 0, so no value is bounded away)."""
    if not preds or not gts:
        return tuple((-1, 0.0) for _ in preds)
    n_p, n_g = len(preds), len(gts)
    pairs = np.stack(np.meshgrid(np.arange(n_p), np.arange(n_g), indexing="ij"), axis=-1).reshape(-1, 2)
    iou = mask_iou_pairs(preds, gts, pairs, 0.0).reshape(n_p, n_g)
    best = iou.argmax(axis=1)  # first maximum: ties go to the lower GT index
    return tuple(
        (int(j), float(iou[i, j])) if iou[i, j] > 0.0 else (-1, 0.0) for i, j in enumerate(best.tolist())
    )


def detection_breakdown(
    preds: Sequence[Geom],
    gts: Sequence[Geom],
    cfg: MatchingConfig,
    *,
    gate: MatchResult | None = None,
    thresholds: Sequence[float] = IOU_THRESHOLDS,
) -> DetectionBreakdown:
    """The detection figures of one sample.

    Args:
        preds: geometries of the valid predictions, in appearance order (`(geom_type, bins)`).
        gts: geometries of the well-formed GT objects, in GT order.
        cfg: `stage2.matching` (the gate matching; thresholds replace only its `maskiou_gate`).
        gate: `match(preds, gts, cfg)` when the caller already has it (it is not recomputed).
        thresholds: maskIoU thresholds for the `TP@t` assignments.
    """
    gate_result = gate if gate is not None else match(preds, gts, cfg)
    at = {t: match(preds, gts, cfg.model_copy(update={"maskiou_gate": float(t)})) for t in thresholds}
    best = _best_gt(preds, gts)
    duplicates = _duplicates(best, gate_result, cfg.maskiou_gate)
    return DetectionBreakdown(gate_result, at, best, duplicates, len(preds), len(gts))


def _duplicates(
    best: Sequence[tuple[int, float]], gate_result: MatchResult, maskiou_gate: float
) -> tuple[int, ...]:
    """The module docstring's duplicates, from every prediction's best GT (:func:`_best_gt`)."""
    matched_gt = {g for _, g, _ in gate_result.pairs}
    # gate.fp holds the unmatched predictions, so a matched best GT is matched to another prediction.
    return tuple(p for p in gate_result.fp if best[p][0] in matched_gt and best[p][1] >= maskiou_gate)


def duplicate_predictions(
    preds: Sequence[Geom], gts: Sequence[Geom], gate_result: MatchResult, maskiou_gate: float
) -> tuple[int, ...]:
    """Indices (ascending) of the predictions that are duplicates (the module docstring) under the gate
    matching ``gate_result`` of ``preds`` to ``gts`` at ``maskiou_gate``: what ``duplicates`` counts."""
    return _duplicates(_best_gt(preds, gts), gate_result, maskiou_gate)


def detection_counts(breakdown: DetectionBreakdown) -> dict[str, float]:
    """Summable counts of one sample: `matched_iou50`, `matched_iou75`, `matched_iou95` (one per threshold)
    and `duplicates`. Sum them over samples (and ranks), then pass the sums to `detection_rates`."""
    counts = {f"matched_{threshold_tag(t)}": float(len(r.pairs)) for t, r in breakdown.at.items()}
    counts["duplicates"] = float(len(breakdown.duplicates))
    return counts


def prf(matched: float, pred: float, gt: float) -> tuple[float, float, float]:
    """`(precision, recall, F1)` of summed counts: `matched / max(pred, 1)`, `matched / max(gt, 1)`, and their
    harmonic mean (0 when both are 0)."""
    precision, recall = matched / max(pred, 1.0), matched / max(gt, 1.0)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return precision, recall, f1


def detection_rates(
    sums: Mapping[str, float], thresholds: Sequence[float] = IOU_THRESHOLDS
) -> dict[str, float]:
    """Rates of summed counts (unprefixed keys; `eval_metrics` prefixes them with `eval_rollout_`).

    Reads `matched`, `valid_pred_objects`, `gt_objects` (the gate matching, as `score_rollout` counts them),
    `matched_iou*`, `duplicates`, `matched_maskiou_sum` / `_count`, `parse_obj_total`.

    Returns:
        `precision`, `recall`, `f1` (gate); `precision_iouXX`, `recall_iouXX`, `f1_iouXX` per threshold;
        `duplicates` (count) and `duplicate_rate` (duplicates / valid predictions); `pred_gt_ratio`;
        `matched_maskiou_mean` (mean maskIoU of the gate pairs); `parse_valid_rate` (valid objects / objects
        the parser saw, 0 when it saw none).
    """
    pred, gt = sums.get("valid_pred_objects", 0.0), sums.get("gt_objects", 0.0)
    out: dict[str, float] = {}
    out["precision"], out["recall"], out["f1"] = prf(sums.get("matched", 0.0), pred, gt)
    for t in thresholds:
        tag = threshold_tag(t)
        p, r, f = prf(sums.get(f"matched_{tag}", 0.0), pred, gt)
        out[f"precision_{tag}"], out[f"recall_{tag}"], out[f"f1_{tag}"] = p, r, f
    duplicates = sums.get("duplicates", 0.0)
    out["duplicates"] = duplicates
    out["duplicate_rate"] = duplicates / max(pred, 1.0)
    out["pred_gt_ratio"] = pred / max(gt, 1.0)
    out["matched_maskiou_mean"] = sums.get("matched_maskiou_sum", 0.0) / max(
        sums.get("matched_maskiou_count", 0.0), 1.0
    )
    out["parse_valid_rate"] = pred / max(sums.get("parse_obj_total", 0.0), 1.0)
    return out

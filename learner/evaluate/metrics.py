"""The evaluation command's figures: the training loop's `eval_rollout_*` metrics (one definition:
`learner.stage2.pipeline.eval_metrics`), a per-category breakdown, and the summary table printed at the end.

Per category (a category is an object's `desc`): `gt` = GT objects with that desc, `pred` = valid predictions
with that desc, `matched` = gate pairs (the class-agnostic training matching) whose prediction AND GT carry
that desc. Precision / recall / F1 as `learner.stage2.matching.breakdown.prf`. A matched pair whose descs
differ counts for neither category, so per-category F1 can sit below the class-agnostic F1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from learner.predictions.records import SamplePrediction
from learner.stage2.matching.breakdown import IOU_THRESHOLDS, prf, threshold_tag

__all__ = ["PREFIX", "per_category", "summary_table"]

PREFIX = "eval_rollout_"
"""Key prefix of the training loop's evaluation metrics (`eval_metrics(prefix="eval")`)."""


def per_category(predictions: Iterable[SamplePrediction]) -> dict[str, dict[str, float]]:
    """`{desc: {gt, pred, matched, precision, recall, f1}}`, sorted by desc (module docstring)."""
    counts: dict[str, dict[str, float]] = {}

    def bump(desc: str, key: str) -> None:
        row = counts.setdefault(desc, {"gt": 0.0, "pred": 0.0, "matched": 0.0})
        row[key] += 1.0

    for sample in predictions:
        for g in sample.gts:
            bump(g.desc, "gt")
        for p in sample.preds:
            bump(p.desc, "pred")
            if p.gt is not None and sample.gts[p.gt].desc == p.desc:
                bump(p.desc, "matched")
    out: dict[str, dict[str, float]] = {}
    for desc in sorted(counts):
        row = counts[desc]
        precision, recall, f1 = prf(row["matched"], row["pred"], row["gt"])
        out[desc] = {**row, "precision": precision, "recall": recall, "f1": f1}
    return out


def _rows(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    fmt = "|" + "|".join(f" {{:{'<' if i == 0 else '>'}{w}}} " for i, w in enumerate(widths)) + "|"
    return [line, fmt.format(*header), line, *(fmt.format(*r) for r in rows), line]


def summary_table(metrics: Mapping[str, Any], gate: float) -> str:
    """The printed summary: P/R/F1 at the gate and each threshold, the other rates, COCO AP (when computed)
    and the per-category rows of `metrics` (the dict written to `metrics.json`)."""

    def get(name: str) -> float:
        return float(metrics.get(PREFIX + name, 0.0))

    lines = [f"{int(metrics.get('samples', 0))} samples"]
    rows = [[f"gate (maskIoU >= {gate:.2f})", *(f"{get(k):.3f}" for k in ("precision", "recall", "f1"))]]
    for t in IOU_THRESHOLDS:
        tag = threshold_tag(t)
        rows.append(
            [f"maskIoU >= {t:.2f}", *(f"{get(f'{k}_{tag}'):.3f}" for k in ("precision", "recall", "f1"))]
        )
    lines += _rows(["matching", "precision", "recall", "F1"], rows)
    other = [
        ["mean IoU of matched pairs", f"{get('matched_maskiou_mean'):.3f}"],
        ["parse-valid rate (valid / parsed objects)", f"{get('parse_valid_rate'):.3f}"],
        ["samples with a valid prediction", f"{get('sample_valid_pred_rate'):.3f}"],
        ["truncated rollouts", f"{get('parse_truncated_rate'):.3f}"],
        [
            "predicted / GT objects",
            f"{get('pred_gt_ratio'):.3f} ({get('pred_objects'):.0f} / {get('gt_objects'):.0f})",
        ],
        ["duplicate predictions", f"{get('duplicates'):.0f} ({get('duplicate_rate'):.3f} of predictions)"],
    ]
    order = metrics.get("object_order") or {}
    if order.get("pairs"):
        agreement = ", ".join(f"{k} {v:.2f}" for k, v in order["agreement"].items())
        other.append(
            [
                "object order followed (pair agreement)",
                f"{order['follows'] or 'none'} ({agreement}; {order['pairs']} pairs)",
            ]
        )
    coco = metrics.get("coco") or {}
    for key in ("segm_AP", "segm_AP50", "segm_AP75", "bbox_AP", "bbox_AP50", "bbox_AP75"):
        if key in coco:
            other.append([f"COCO {key.replace('_', ' ')}", f"{coco[key]:.3f}"])
    lines += _rows(["figure", "value"], other)
    cats = metrics.get("per_category") or {}
    if cats:
        lines += _rows(
            ["category", "GT", "pred", "matched", "precision", "recall", "F1"],
            [
                [
                    desc,
                    f"{row['gt']:.0f}",
                    f"{row['pred']:.0f}",
                    f"{row['matched']:.0f}",
                    f"{row['precision']:.3f}",
                    f"{row['recall']:.3f}",
                    f"{row['f1']:.3f}",
                ]
                for desc, row in cats.items()
            ],
        )
    return "\n".join(lines)

"""Per-category figures and the printed summary table."""

from __future__ import annotations

from learner.evaluate.metrics import per_category, summary_table
from learner.stage2.pipeline import eval_metrics
from tests.unit.learner.evaluate.helpers import gt, pred, sample


def test_per_category_counts_only_pairs_whose_descs_agree():
    s = sample(
        0,
        [pred((1, 1, 9, 9), desc="cat", gt=0, iou=1.0), pred((20, 20, 30, 30), desc="dog", gt=1, iou=1.0)],
        [gt((1, 1, 9, 9), desc="cat", pred_index=0), gt((20, 20, 30, 30), desc="cow", pred_index=1)],
    )
    cats = per_category([s])
    assert list(cats) == ["cat", "cow", "dog"]
    assert cats["cat"]["f1"] == 1.0
    assert cats["cow"] == {"gt": 1.0, "pred": 0.0, "matched": 0.0, "precision": 0.0, "recall": 0.0, "f1": 0.0}
    assert cats["dog"]["pred"] == 1.0 and cats["dog"]["matched"] == 0.0


def test_table_lists_every_threshold_and_the_coco_figures():
    metrics = {
        "samples": 2,
        **eval_metrics(
            {"matched": 1.0, "valid_pred_objects": 2.0, "gt_objects": 2.0}, n_samples=2, runtime_s=1
        ),
        "coco": {"segm_AP": 0.25, "bbox_AP50": 0.5},
        "per_category": per_category([sample(0, [], [gt((1, 1, 2, 2), desc="cat")])]),
    }
    table = summary_table(metrics, gate=0.3)
    for text in (
        "gate (maskIoU >= 0.30)",
        "maskIoU >= 0.50",
        "maskIoU >= 0.95",
        "COCO segm AP",
        "0.250",
        "cat",
    ):
        assert text in table


def test_table_names_the_object_order_the_model_follows():
    order = {"agreement": {"listed": 0.5, "sorted": 0.97}, "pairs": 120, "follows": "sorted"}
    table = summary_table({"samples": 2, "object_order": order}, gate=0.3)
    assert "object order followed (pair agreement)" in table
    assert "sorted (listed 0.50, sorted 0.97; 120 pairs)" in table
    assert "object order" not in summary_table({"samples": 2, "object_order": {"pairs": 0}}, gate=0.3)

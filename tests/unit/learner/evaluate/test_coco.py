"""COCO export and AP through pycocotools on a hand-made case with a known AP."""

from __future__ import annotations

import pytest

from learner.evaluate.coco import coco_ap, coco_datasets
from tests.unit.learner.evaluate.helpers import gt, pred, sample

BOX, WRONG = (100, 100, 300, 300), (600, 600, 800, 800)


def test_known_ap():
    # Two images, one GT box each. Ranked by score: TP (-0.1), FP (-0.2), TP (-0.5): recall 0.5, 0.5, 1.0 with
    # precision 1, 1/2, 2/3. COCO's 101-point interpolated AP: 51 recall points at precision 1 and 50 at 2/3,
    # the same at every IoU threshold (the TPs are exact, the FP overlaps nothing).
    samples = [
        sample(0, [pred(BOX, score=-0.1, gt=0, iou=1.0)], [gt(BOX, pred_index=0)]),
        sample(1, [pred(WRONG, score=-0.2), pred(BOX, score=-0.5, gt=0, iou=1.0)], [gt(BOX, pred_index=1)]),
    ]
    known = (51 + 50 * 2 / 3) / 101
    ap = coco_ap(samples)
    for kind in ("segm", "bbox"):
        for key in ("AP", "AP50", "AP75"):
            assert ap[f"{kind}_{key}"] == pytest.approx(known, abs=1e-6)


def test_a_higher_score_on_the_false_positive_lowers_ap():
    samples = [
        sample(0, [pred(BOX, score=-0.5, gt=0, iou=1.0)], [gt(BOX, pred_index=0)]),
        sample(1, [pred(WRONG, score=-0.1)], [gt(BOX)]),
    ]
    # FP first: precision 0 at rank 1, then 1/2 at recall 0.5 → 51 points at 0.5
    assert coco_ap(samples)["bbox_AP50"] == pytest.approx(51 * 0.5 / 101, abs=1e-6)


def test_export_in_pixels_with_polygon_masks_and_every_desc_a_category():
    s = sample(
        3,
        [pred((0, 0, 999, 0, 999, 999), desc="dog", geom="poly", score=-1.0)],
        [gt((0, 0, 999, 999), desc="cat")],
        size=(101, 51),
    )
    gt_data, results = coco_datasets([s])
    assert [c["name"] for c in gt_data["categories"]] == ["cat", "dog"]
    ann = gt_data["annotations"][0]
    assert ann["bbox"] == [0.0, 0.0, 100.0, 50.0] and ann["area"] == pytest.approx(5000.0)
    assert ann["segmentation"] == [[0.0, 0.0, 100.0, 0.0, 100.0, 50.0, 0.0, 50.0]]
    assert results[0]["segmentation"] == [[0.0, 0.0, 100.0, 0.0, 100.0, 50.0]]
    assert results[0]["score"] == -1.0 and results[0]["category_id"] == 2 and results[0]["image_id"] == 3


def test_no_predictions_gives_zero():
    assert coco_ap([sample(0, [], [gt(BOX)])])["segm_AP"] == 0.0

"""Hand-made evaluated samples for the evaluation command's unit tests."""

from __future__ import annotations

from pathlib import Path

from learner.predictions.records import GtObject, PredObject, SamplePrediction


def pred(bins, *, desc="a", score=None, gt=None, iou=0.0, duplicate=False, geom="bbox_2d") -> PredObject:
    return PredObject(desc, geom, tuple(bins), score, gt, iou, gt if gt is not None else -1, iou, duplicate)


def gt(bins, *, desc="a", pred_index=None, geom="bbox_2d") -> GtObject:
    return GtObject(desc, geom, tuple(bins), pred_index)


def sample(index, preds, gts, *, image: Path | None = None, size=(1000, 1000)) -> SamplePrediction:
    matched = sum(p.gt is not None for p in preds)
    counts = {
        "matched": float(matched),
        "valid_pred_objects": float(len(preds)),
        "gt_objects": float(len(gts)),
    }
    return SamplePrediction(
        index,
        index,
        "d",
        index,
        str(image) if image else None,
        size[0],
        size[1],
        tuple(preds),
        tuple(gts),
        counts,
        "stop",
        "",
    )


def png(path: Path, size=(64, 48)) -> Path:
    from PIL import Image

    Image.new("RGB", size, (200, 210, 220)).save(path)
    return path

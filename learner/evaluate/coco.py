"""COCO export and COCO AP (pycocotools, the `eval` extra): ground truth and predictions of evaluated samples
as COCO datasets, evaluated for both `segm` (polygon masks) and `bbox`.

Conventions: one COCO image per sample (`id` = its index), pixel coordinates from norm1000 bins by
`learner.stage2.coords.bin_to_pixel` (`k / 999 * (size - 1)`); a box's segmentation is its four-corner
polygon, a polygon's box is its axis-aligned hull; categories are the descs seen in GT or predictions (ids
from 1 in sorted order), so a prediction with an unseen desc is a false positive rather than ignored. Each
prediction's score is its mean token log-probability (`learner.predictions.records`; not a calibrated
detector score); without log-probabilities every score is 0 and AP depends on the export order. GT areas
are polygon areas; `iscrowd` is 0.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from typing import Any

from learner.predictions.records import SamplePrediction
from learner.stage2.coords import bin_to_pixel

__all__ = ["COCO_KEYS", "coco_ap", "coco_datasets", "require_pycocotools"]

COCO_KEYS = ("AP", "AP50", "AP75")
"""The COCOeval `stats[0:3]` figures reported per IoU type (AP over IoU 0.50:0.95, at 0.50, at 0.75)."""


def _pixels(geom_type: str, bins: Sequence[int], width: int, height: int) -> list[float]:
    """Flat polygon `[x0, y0, x1, y1, ...]` in pixels (a box as its four corners, clockwise from top-left)."""
    if geom_type == "bbox_2d":
        x1, y1, x2, y2 = bins
        bins = (x1, y1, x2, y1, x2, y2, x1, y2)
    return [bin_to_pixel(int(k), width if i % 2 == 0 else height) for i, k in enumerate(bins)]


def _area(poly: Sequence[float]) -> float:
    xs, ys = poly[0::2], poly[1::2]
    n = len(xs)
    return abs(sum(xs[i] * ys[(i + 1) % n] - xs[(i + 1) % n] * ys[i] for i in range(n))) / 2.0


def _bbox(poly: Sequence[float]) -> list[float]:
    xs, ys = poly[0::2], poly[1::2]
    return [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)]


def coco_datasets(samples: Sequence[SamplePrediction]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`(ground-truth dataset, results list)` in COCO's JSON formats (module docstring)."""
    descs = sorted({g.desc for s in samples for g in s.gts} | {p.desc for s in samples for p in s.preds})
    cat = {d: i + 1 for i, d in enumerate(descs)}
    images, annotations, results = [], [], []
    for s in samples:
        images.append({"id": s.index, "width": s.width, "height": s.height, "file_name": s.image or ""})
        for g in s.gts:
            poly = _pixels(g.geom_type, g.bins, s.width, s.height)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": s.index,
                    "category_id": cat[g.desc],
                    "segmentation": [poly],
                    "bbox": _bbox(poly),
                    "area": _area(poly),
                    "iscrowd": 0,
                }
            )
        for p in s.preds:
            poly = _pixels(p.geom_type, p.bins, s.width, s.height)
            results.append(
                {
                    "image_id": s.index,
                    "category_id": cat[p.desc],
                    "segmentation": [poly],
                    "bbox": _bbox(poly),
                    "score": float(p.score) if p.score is not None else 0.0,
                }
            )
    gt = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i, "name": d} for d, i in cat.items()],
    }
    return gt, results


def require_pycocotools() -> tuple[Any, Any]:
    """pycocotools' `(COCO, COCOeval)` classes.

    Raises:
        ImportError: pycocotools is not installed (names the extra to install, and the flag that skips AP).
    """
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as exc:
        raise ImportError(
            "COCO AP needs pycocotools: pip install -e '.[eval]' (or pass --no-coco to skip it)"
        ) from exc
    return COCO, COCOeval


def coco_ap(samples: Sequence[SamplePrediction]) -> dict[str, float]:
    """COCO AP of the samples' predictions: `segm_AP`, `segm_AP50`, `segm_AP75`, `bbox_AP`, `bbox_AP50`,
    `bbox_AP75` (COCOeval's -1 for "no GT objects" is reported as 0; no predictions → all 0).

    Raises:
        ImportError: pycocotools is not installed (names the extra to install).
    """
    COCO, COCOeval = require_pycocotools()  # noqa: N806 - pycocotools' class names
    gt_data, results = coco_datasets(samples)
    out = {f"{kind}_{key}": 0.0 for kind in ("segm", "bbox") for key in COCO_KEYS}
    if not results or not gt_data["annotations"]:
        return out
    with contextlib.redirect_stdout(io.StringIO()):  # COCO prints progress and the 12-line summary
        gt = COCO()
        gt.dataset = gt_data
        gt.createIndex()
        for kind in ("segm", "bbox"):
            dt = gt.loadRes([dict(r) for r in results])  # loadRes rewrites areas/ids in place
            ev = COCOeval(gt, dt, iouType=kind)
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
            for key, value in zip(COCO_KEYS, ev.stats[:3], strict=True):
                out[f"{kind}_{key}"] = max(float(value), 0.0)
    return out

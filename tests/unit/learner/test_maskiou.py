"""Exact maskIoU fast paths agree with the plain GEOS overlay (docs/ALGORITHM.md#matching §8.2 step 4;
learner/stage2/matching/maskiou.py).

The reference below is the definition the module replaced: every geometry is a shapely polygon of its ring
clamped to [0, 999] (bbox → its corners), repaired with ``make_valid`` when invalid, and the IoU is
``area(a ∩ b) / area(a ∪ b)`` by a general overlay. The fast paths (closed-form boxes, numpy trapezoids for
simple rings, rectangle clipping for repaired polygons) must give the same IoU to float rounding.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import shapely

from learner.stage2.coords import canonicalize_poly
from learner.stage2.matching.maskiou import geom_table, mask_iou, mask_iou_pairs, pair_ious
from learner.stage2.matching.match import MatchingConfig, match

TOL = 1e-9


def _shape(geom) -> shapely.Geometry | None:
    kind, bins = geom
    if kind == "bbox_2d":
        x1, y1, x2, y2 = bins
        pts = [(x1, y1), (x2, y1), (x2, y2), (x1, y2)]
    else:
        pts = list(zip(bins[0::2], bins[1::2], strict=True))
    if len(pts) < 3:
        return None
    poly = shapely.Polygon(np.clip(np.array(pts, dtype=float), 0.0, 999.0))
    return poly if poly.is_valid else shapely.make_valid(poly)


def _reference_iou(a, b) -> float:
    sa, sb = _shape(a), _shape(b)
    if sa is None or sb is None:
        return 0.0
    inter = shapely.intersection(sa, sb).area
    union = sa.area + sb.area - inter
    return inter / union if union > 0 else 0.0


def _box(rng: random.Random, spill: bool) -> tuple[str, tuple[int, ...]]:
    lo, hi = (-80, 1080) if spill else (0, 999)
    x, y = rng.randint(lo, hi), rng.randint(lo, hi)
    w, h = rng.randint(-30, 300), rng.randint(-30, 300)  # negative: an unsorted bbox
    return "bbox_2d", (x, y, x + w, y + h)


def _poly(rng: random.Random, kind: str, spill: bool) -> tuple[str, tuple[int, ...]]:
    lo, hi = (-80, 1080) if spill else (50, 950)
    cx, cy = rng.randint(lo, hi), rng.randint(lo, hi)
    k = rng.randint(3, 9)
    if kind == "star":  # canonical order (§2.4): star-shaped, usually concave
        ang = sorted(rng.uniform(0, 2 * math.pi) for _ in range(k))
        pts = [
            (round(cx + rng.uniform(10, 200) * math.cos(a)), round(cy + rng.uniform(10, 200) * math.sin(a)))
            for a in ang
        ]
        pts = list(zip(*[iter(canonicalize_poly(pts)[1])] * 2, strict=True))
    elif kind == "wild":  # arbitrary vertex order: self-intersecting rings, repaired even-odd
        pts = [(cx + rng.randint(-200, 200), cy + rng.randint(-200, 200)) for _ in range(k)]
    elif kind == "comb":  # a concave comb that is simple but not star-shaped from its vertex mean
        teeth = rng.randint(2, 4)
        w = rng.randint(20, 60)
        top = [
            (cx + i * w + dx, cy + (0 if dx == 0 else rng.randint(60, 200)))
            for i in range(teeth)
            for dx in (0, w // 2)
        ]
        pts = [(cx, cy - 40), *top, (cx + teeth * w, cy), (cx + teeth * w, cy - 40)]
    else:  # "tiny": degenerate and repeated vertices, collinear runs, fewer than 3 points
        pts = [(cx + rng.randint(-3, 3), cy + rng.randint(-3, 3)) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.5:
            pts.append(pts[0])
    return "poly", tuple(v for p in pts for v in p)


def _geom(rng: random.Random) -> tuple[str, tuple[int, ...]]:
    spill = rng.random() < 0.3  # partly (or wholly) outside [0, 999]
    r = rng.random()
    if r < 0.3:
        return _box(rng, spill)
    return _poly(rng, "star" if r < 0.6 else "wild" if r < 0.75 else "comb" if r < 0.9 else "tiny", spill)


def _near(g, rng: random.Random) -> tuple[str, tuple[int, ...]]:
    """A jittered copy: overlapping pairs with nearly coincident edges (the hard case for an overlay)."""
    kind, bins = g
    return kind, tuple(v + rng.randint(-4, 4) for v in bins)


@pytest.mark.parametrize("seed", range(40))
def test_pair_ious_equal_the_geos_overlay(seed: int) -> None:
    rng = random.Random(seed)
    geoms = [_geom(rng) for _ in range(30)]
    geoms += [_near(g, rng) for g in geoms[:15]]
    n = len(geoms)
    ia = np.array([i for i in range(n) for _ in range(n)])
    ib = np.array([j for _ in range(n) for j in range(n)])
    got = pair_ious(geom_table(geoms), ia, ib, gate=0.0)  # gate 0: every value exact
    want = np.array([_reference_iou(geoms[i], geoms[j]) for i, j in zip(ia, ib, strict=True)])
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


@pytest.mark.parametrize("seed", range(10))
def test_gate_pruning_keeps_every_value_above_the_gate_exact(seed: int) -> None:
    rng = random.Random(100 + seed)
    preds = [_geom(rng) for _ in range(25)]
    gts = [_near(p, rng) if rng.random() < 0.7 else _geom(rng) for p in preds]
    pairs = np.array([(i, j) for i in range(len(preds)) for j in range(len(gts))])
    gate = 0.3
    got = mask_iou_pairs(preds, gts, pairs, gate)
    want = np.array([_reference_iou(preds[i], gts[j]) for i, j in pairs])
    above = want >= gate + TOL
    np.testing.assert_allclose(got[above], want[above], rtol=0, atol=TOL)
    assert ((got >= gate) == (want >= gate))[np.abs(want - gate) > TOL].all()
    assert (got[want < gate - TOL] < gate).all()


def test_box_against_repaired_polygon_uses_rectangle_clipping() -> None:
    bowtie = ("poly", (0, 0, 100, 100, 100, 0, 0, 100))  # self-intersecting: repaired to two triangles
    for box in [
        ("bbox_2d", (0, 0, 100, 100)),
        ("bbox_2d", (-50, 20, 60, 2000)),
        ("bbox_2d", (90, 90, 10, 10)),
    ]:
        assert mask_iou(bowtie, box) == pytest.approx(_reference_iou(bowtie, box), abs=TOL)
        assert mask_iou(box, bowtie) == pytest.approx(_reference_iou(box, bowtie), abs=TOL)


def test_given_boxes_and_mask_iou_agree_with_the_table_path() -> None:
    rng = random.Random(7)
    preds = [_geom(rng) for _ in range(12)]
    gts = [_near(p, rng) for p in preds]
    pairs = np.array([(i, j) for i in range(12) for j in range(12)])
    boxes_p = geom_table(preds).boxes
    boxes_g = geom_table(gts).boxes
    plain = mask_iou_pairs(preds, gts, pairs, 0.0)
    np.testing.assert_array_equal(mask_iou_pairs(preds, gts, pairs, 0.0, boxes_p, boxes_g), plain)
    assert [mask_iou(preds[i], gts[j]) for i, j in pairs] == pytest.approx(plain.tolist(), abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_match_ious_equal_the_reference(seed: int) -> None:
    rng = random.Random(1000 + seed)
    gts = [_geom(rng) for _ in range(rng.randint(1, 25))]
    preds = [_near(g, rng) for g in gts if rng.random() < 0.8] + [_geom(rng) for _ in range(3)]
    result = match(preds, gts, MatchingConfig(maskiou_gate=rng.choice([0.0, 0.3, 0.5])))
    for p, g, iou in result.pairs:
        assert iou == pytest.approx(_reference_iou(preds[p], gts[g]), abs=TOL)


def test_geom_table_reads_boxes_and_polygons() -> None:
    t = geom_table([("bbox_2d", (30, 40, 10, 20)), ("poly", ()), ("poly", (5, 9, 1, 3, 7, 2))])
    assert t.boxes.tolist() == [[10, 20, 30, 40], [0, 0, 0, 0], [1, 2, 7, 9]]
    assert t.is_box.tolist() == [True, False, False] and t.count.tolist() == [0, 0, 3]
    assert t.xy.tolist() == [[5, 9], [1, 3], [7, 2]] and t.start.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="bbox_2d geometry needs 4 bins"):
        geom_table([("bbox_2d", (1, 2, 3))])
    with pytest.raises(ValueError, match="even number"):
        geom_table([("poly", (1, 2, 3))])
    with pytest.raises(ValueError, match="unknown geom_type"):
        geom_table([("mask", (1, 2))])

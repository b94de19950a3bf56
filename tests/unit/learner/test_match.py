"""Matching (docs/ALGORITHM.md#matching, required tests §20.7, matching part of §21.3)."""

from __future__ import annotations

import random

import numpy as np
import pydantic
import pytest

from learner.stage2.matching.match import (
    MatchingConfig,
    aabb,
    aabb_iou,
    candidate_lists,
    mask_iou,
    match,
)


def box(*v: int) -> tuple[str, tuple[int, ...]]:
    return ("bbox_2d", tuple(v))


def poly(*v: int) -> tuple[str, tuple[int, ...]]:
    return ("poly", tuple(v))


# ---------------------------------------------------------------- §20.7


def test_identical_boxes_two_matches_iou_one() -> None:
    g = [box(100, 100, 200, 200), box(500, 500, 700, 650)]
    r = match(g, g, MatchingConfig())
    assert [(p, q) for p, q, _ in r.pairs] == [(0, 0), (1, 1)]
    assert [iou for _, _, iou in r.pairs] == [1.0, 1.0]
    assert r.fp == () and r.fn == ()
    assert r.iou_sum == 2.0 and r.iou_count == 2


def test_disjoint_boxes_gate_half() -> None:
    preds = [box(0, 0, 100, 100), box(200, 200, 300, 300)]
    gts = [box(500, 500, 600, 600), box(700, 700, 800, 800)]
    r = match(preds, gts, MatchingConfig(maskiou_gate=0.5))
    assert r.pairs == ()
    assert r.fp == (0, 1) and r.fn == (0, 1)
    assert r.gating_rejections == 4
    assert r.candidate_pairs == 4


def test_conflict_first_prediction_wins() -> None:
    preds = [box(100, 100, 200, 200), box(105, 105, 205, 205)]
    r = match(preds, [box(100, 100, 200, 200)], MatchingConfig())
    assert r.pairs == ((0, 0, 1.0),)
    assert r.fp == (1,) and r.fn == ()


def test_center_distance_fallback_k1() -> None:
    preds = [box(0, 0, 50, 50)]
    gts = [box(100, 100, 150, 150), box(600, 600, 700, 700)]
    cands = candidate_lists(np.array([aabb(preds[0])]), np.array([aabb(g) for g in gts]), 1)
    assert cands[0].tolist() == [0]
    r = match(preds, gts, MatchingConfig(candidate_top_k=1))
    assert r.candidate_pairs == 1
    assert r.gating_rejections == 1
    assert r.pairs == () and r.fp == (0,) and r.fn == (0, 1)


def test_mask_iou_box_vs_box_r256() -> None:
    a, b = box(100, 200, 300, 400), box(110, 190, 310, 420)
    assert abs(mask_iou(a, b, 256) - 0.7917) < 0.02
    # Exact polygon IoU = continuous IoU: 190*200 / (200*200 + 200*230 - 190*200).
    assert mask_iou(a, b) == pytest.approx(38000 / 48000, abs=1e-12)


def test_mask_iou_triangle_vs_box_r256() -> None:
    tri = poly(100, 100, 200, 100, 150, 200)
    assert abs(mask_iou(tri, box(100, 100, 200, 200), 256) - 0.5) < 0.03
    assert mask_iou(tri, box(100, 100, 200, 200)) == pytest.approx(0.5, abs=1e-12)


# ---------------------------------------------------------------- §21.3 worked example


def test_worked_example_matching_section_21_3() -> None:
    preds = [box(104, 84, 296, 610), box(880, 60, 990, 180)]
    gts = [box(100, 80, 300, 620), box(520, 400, 760, 640), poly(400, 650, 900, 650, 900, 950, 400, 950)]
    assert aabb_iou(preds[0], gts[0]) == pytest.approx(0.9351, abs=1e-4)
    r = match(preds, gts, MatchingConfig(fn_cost=2.0))
    assert [(p, g) for p, g, _ in r.pairs] == [(0, 0)]
    assert r.pairs[0][2] == pytest.approx(0.9351, abs=1e-4)
    assert r.fp == (1,) and r.fn == (1, 2)
    assert r.gating_rejections == 5 and r.candidate_pairs == 6


# ---------------------------------------------------------------- details of §8.2


def test_empty_sides() -> None:
    r = match([], [box(0, 0, 10, 10)], MatchingConfig())
    assert r.fn == (0,) and r.fp == () and r.candidate_pairs == 0
    r = match([box(0, 0, 10, 10)], [], MatchingConfig())
    assert r.fp == (0,) and r.fn == () and r.candidate_pairs == 0


def test_candidate_ties_lower_gt_index_first() -> None:
    # Two identical GTs: equal AABB IoU → lower index first; k=1 keeps only GT 0.
    pb = np.array([[0.0, 0.0, 10.0, 10.0]])
    gb = np.array([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 15.0, 15.0]])
    assert candidate_lists(pb, gb, 2)[0].tolist() == [0, 1]
    # Center-distance ties: two GTs at equal distance on either side.
    pb = np.array([[100.0, 100.0, 110.0, 110.0]])
    gb = np.array([[200.0, 100.0, 210.0, 110.0], [0.0, 100.0, 10.0, 110.0], [-100.0, 100, -90, 110]])
    assert candidate_lists(pb, gb, 3)[0].tolist() == [0, 1, 2]


def test_aabb_of_unsorted_bbox_and_poly() -> None:
    assert aabb(box(300, 400, 100, 200)) == (100.0, 200.0, 300.0, 400.0)
    assert aabb(poly(5, 9, 1, 3, 7, 2)) == (1.0, 2.0, 7.0, 9.0)
    # A reversed bbox is the same rectangle as its sorted form.
    assert mask_iou(box(300, 400, 100, 200), box(100, 200, 300, 400)) == pytest.approx(1.0)


def test_degenerate_and_clamped_geometry() -> None:
    assert mask_iou(box(10, 10, 10, 50), box(0, 0, 100, 100)) == 0.0  # zero area
    assert mask_iou(poly(0, 0, 10, 10, 20, 20), box(0, 0, 100, 100)) == 0.0  # collinear ring
    # Bins beyond 999 are clamped to the canvas.
    assert mask_iou(box(900, 900, 1200, 1200), box(900, 900, 999, 999)) == pytest.approx(1.0)


def test_self_intersecting_ring_even_odd() -> None:
    bowtie = poly(0, 0, 100, 100, 100, 0, 0, 100)  # two triangles of area 2500 each
    left = poly(0, 0, 50, 50, 0, 100)
    assert mask_iou(bowtie, left) == pytest.approx(0.5)
    assert mask_iou(bowtie, box(0, 0, 100, 100)) == pytest.approx(0.5)


def test_gate_zero_and_costs_decide_acceptance() -> None:
    # fp_cost + fn_cost < 1 - IoU: leaving both unmatched is cheaper than the pair.
    preds, gts = [box(0, 0, 100, 100)], [box(50, 0, 150, 100)]  # IoU 1/3
    assert match(preds, gts, MatchingConfig(maskiou_gate=0.0)).pairs != ()
    r = match(preds, gts, MatchingConfig(maskiou_gate=0.0, fp_cost=0.2, fn_cost=0.2))
    assert r.pairs == () and r.fp == (0,) and r.fn == (0,)


def test_config_forbids_unknown_and_is_frozen() -> None:
    with pytest.raises(pydantic.ValidationError):
        MatchingConfig(top_k=3)
    cfg = MatchingConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.maskiou_gate = 0.1
    assert (cfg.candidate_top_k, cfg.maskiou_resolution, cfg.maskiou_gate, cfg.fp_cost, cfg.fn_cost) == (
        5,
        256,
        0.3,
        1.0,
        1.0,
    )


# ---------------------------------------------------------------- brute force optimum


def _random_geom(rng: random.Random) -> tuple[str, tuple[int, ...]]:
    cx, cy = rng.randint(0, 400), rng.randint(0, 400)
    if rng.random() < 0.5:
        w, h = rng.randint(1, 200), rng.randint(1, 200)
        return box(cx, cy, min(cx + w, 999), min(cy + h, 999))
    n = rng.randint(3, 7)
    pts = []
    for _ in range(n):
        pts += [min(999, cx + rng.randint(0, 200)), min(999, cy + rng.randint(0, 200))]
    return poly(*pts)


def _brute_force(preds, gts, cfg: MatchingConfig) -> tuple[float, int, int]:
    """Optimal objective over all partial assignments, plus rejection and candidate counts."""
    n_p, n_g = len(preds), len(gts)
    feasible: dict[tuple[int, int], float] = {}
    rejections = candidates = 0
    for i, p in enumerate(preds):
        pa = aabb(p)
        ious = [aabb_iou(p, g) for g in gts]
        if max(ious) > 0:
            order = sorted(range(n_g), key=lambda j: (-ious[j], j))
        else:
            pc = ((pa[0] + pa[2]) / 2, (pa[1] + pa[3]) / 2)

            def d2(j: int, pc: tuple[float, float] = pc) -> float:
                ga = aabb(gts[j])
                return (pc[0] - (ga[0] + ga[2]) / 2) ** 2 + (pc[1] - (ga[1] + ga[3]) / 2) ** 2

            order = sorted(range(n_g), key=lambda j: (d2(j), j))
        for j in order[: cfg.candidate_top_k]:
            candidates += 1
            v = mask_iou(p, gts[j])
            if v < cfg.maskiou_gate:
                rejections += 1
            else:
                feasible[(i, j)] = 1.0 - v

    best = float("inf")

    def rec(i: int, used: frozenset[int], cost: float, m: int) -> None:
        nonlocal best
        if i == n_p:
            best = min(best, cost + cfg.fp_cost * (n_p - m) + cfg.fn_cost * (n_g - m))
            return
        rec(i + 1, used, cost, m)
        for j in range(n_g):
            if j not in used and (i, j) in feasible:
                rec(i + 1, used | {j}, cost + feasible[(i, j)], m + 1)

    rec(0, frozenset(), 0.0, 0)
    return best, rejections, candidates


@pytest.mark.parametrize("seed", range(200))
def test_matches_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    preds = [_random_geom(rng) for _ in range(rng.randint(1, 6))]
    gts = [_random_geom(rng) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.3:  # near-duplicates of GTs make matches likely
        preds[0] = gts[0]
    cfg = MatchingConfig(
        candidate_top_k=rng.randint(1, 6),
        maskiou_gate=rng.choice([0.0, 0.1, 0.3, 0.5]),
        fp_cost=rng.uniform(0.2, 2.0),
        fn_cost=rng.uniform(0.2, 2.0),
    )
    r = match(preds, gts, cfg)
    best, rejections, candidates = _brute_force(preds, gts, cfg)
    m = len(r.pairs)
    got = sum(1.0 - v for _, _, v in r.pairs) + cfg.fp_cost * (len(preds) - m) + cfg.fn_cost * (len(gts) - m)
    assert got == pytest.approx(best, abs=1e-9)
    assert r.gating_rejections == rejections and r.candidate_pairs == candidates
    assert sorted(r.fp + tuple(p for p, _, _ in r.pairs)) == list(range(len(preds)))
    assert sorted(r.fn + tuple(g for _, g, _ in r.pairs)) == list(range(len(gts)))
    for p, g, v in r.pairs:
        assert v == pytest.approx(mask_iou(preds[p], gts[g]), abs=1e-12) and v >= cfg.maskiou_gate


# ---------------------------------------------------------------- exact IoU vs fine raster


def _even_odd_mask(pts: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Even-odd point-in-polygon on the grid ``ys × xs`` (COCO's fill rule)."""
    inside = np.zeros((len(ys), len(xs)), dtype=bool)
    for k in range(len(pts)):
        (x1, y1), (x2, y2) = pts[k], pts[(k + 1) % len(pts)]
        crosses = (y1 > ys) != (y2 > ys)
        if not crosses.any():
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            xint = x1 + (ys - y1) * (x2 - x1) / (y2 - y1)
        inside[crosses] ^= xs[None, :] < xint[crosses, None]
    return inside


def _raster_iou(a, b, n: int = 2000) -> float:
    pa = np.asarray(a[1], float).reshape(-1, 2)
    pb = np.asarray(b[1], float).reshape(-1, 2)
    lo = np.minimum(pa.min(0), pb.min(0))
    hi = np.maximum(pa.max(0), pb.max(0))
    xs = lo[0] + (np.arange(n) + 0.5) * (hi[0] - lo[0]) / n
    ys = lo[1] + (np.arange(n) + 0.5) * (hi[1] - lo[1]) / n
    ma, mb = _even_odd_mask(pa, xs, ys), _even_odd_mask(pb, xs, ys)
    union = (ma | mb).sum()
    return float((ma & mb).sum() / union) if union else 0.0


@pytest.mark.parametrize("seed", range(18))
def test_exact_iou_matches_fine_raster(seed: int) -> None:
    rng = np.random.default_rng(seed)
    center = rng.uniform(200, 800, size=2)
    geoms = []
    for k in range(2):
        n = int(rng.integers(3, 9))
        if seed % 3 == 0:  # arbitrary vertex order: self-intersecting rings
            pts = center + rng.uniform(-150, 150, size=(n, 2))
        elif k == 1 and seed % 3 == 1:  # a jittered copy of the first ring: high IoU
            pts = np.asarray(geoms[0][1], float).reshape(-1, 2) + rng.uniform(
                -15, 15, size=(len(geoms[0][1]) // 2, 2)
            )
        else:  # star-shaped simple rings
            ang = np.sort(rng.uniform(0, 2 * np.pi, n))
            rad = rng.uniform(50, 200, n)
            pts = center + np.stack([rad * np.cos(ang), rad * np.sin(ang)], 1)
        geoms.append(poly(*np.clip(np.rint(pts), 0, 999).astype(int).ravel().tolist()))
    exact = mask_iou(geoms[0], geoms[1])
    if seed % 3 == 1:
        assert exact > 0.5  # the jittered copy really overlaps
    assert exact == pytest.approx(_raster_iou(geoms[0], geoms[1]), abs=1e-2)

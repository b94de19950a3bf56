"""Hungarian matching of valid predictions to GT objects (spec/STAGE2.md §8).

Geometries are ``(geom_type, bins)`` with ``geom_type`` in ``{"bbox_2d", "poly"}`` and ``bins`` a flat
sequence of norm1000 integers (bbox: ``x1, y1, x2, y2``; poly: ``x0, y0, x1, y1, ...``). ``desc`` plays
no part. All indices in a :class:`MatchResult` are 0-based positions in the prediction / GT lists passed
to :func:`match`.

maskIoU choice: the spec's reference is COCO polygon rasterization at ``R = maskiou_resolution``
(pycocotools is not installed here). This module computes the EXACT polygon IoU instead (shapely 2 /
GEOS: area of intersection over area of union of the rings clamped to [0, 999]); the raster IoU is an
estimate of it, within the tolerances of §20.7. Self-intersecting rings are repaired with
``shapely.make_valid`` (linework method = even-odd fill, the fill rule of COCO's rasterizer). IoU is
scale-invariant, so ``(R - 1) / 999`` scaling is not applied and ``resolution`` is accepted only for
interface compatibility. bbox↔bbox pairs use the closed-form rectangle IoU (identical to the polygon IoU
of their corner rings), so shapely is only called for pairs involving a polygon whose boxes overlap.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import shapely
from pydantic import BaseModel, ConfigDict, Field
from scipy.optimize import linear_sum_assignment

from learner.stage2.coords import CoordVocab

__all__ = [
    "INFEASIBLE",
    "Geom",
    "MatchResult",
    "MatchingConfig",
    "aabb",
    "aabb_iou",
    "aabb_iou_matrix",
    "candidate_lists",
    "gt_geoms",
    "mask_iou",
    "mask_iou_pairs",
    "match",
    "pred_geoms",
]

logger = logging.getLogger(__name__)

Geom = tuple[str, Sequence[int]]
"""``(geom_type, flat bins)``; geom_type is ``"bbox_2d"`` or ``"poly"``."""

INFEASIBLE = 1e6
"""Cost of a non-candidate or gated-out pair (finite so the solver always succeeds)."""
_MATCH_COST_LIMIT = 5e5


class MatchingConfig(BaseModel):
    """``stage2.matching.*`` knobs (§8.2)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    candidate_top_k: int = Field(default=5, ge=1)
    """GT candidates kept per prediction (AABB IoU ranking, or center distance when all AABB IoUs are 0)."""
    maskiou_resolution: int = Field(default=256, ge=2)
    """Raster size R of the reference definition; unused by the exact polygon IoU (scale-invariant)."""
    maskiou_gate: float = Field(default=0.3, ge=0.0, le=1.0)
    """Minimum maskIoU for a feasible pair."""
    fp_cost: float = Field(default=1.0, ge=0.0)
    """Cost of leaving a prediction unmatched."""
    fn_cost: float = Field(default=1.0, ge=0.0)
    """Cost of leaving a GT unmatched."""


@dataclass(frozen=True)
class MatchResult:
    """Outcome of :func:`match` (§8.2 step 7).

    Attributes:
        pairs: ``(pred_i, gt_j, mask_iou)`` sorted by ``pred_i``.
        fp: unmatched prediction indices, ascending.
        fn: unmatched GT indices, ascending.
        gating_rejections: candidate pairs with maskIoU below the gate.
        candidate_pairs: number of candidate pairs whose maskIoU was evaluated.
        iou_sum: sum of maskIoU over ``pairs``.
        iou_count: ``len(pairs)``.
    """

    pairs: tuple[tuple[int, int, float], ...]
    fp: tuple[int, ...]
    fn: tuple[int, ...]
    gating_rejections: int
    candidate_pairs: int
    iou_sum: float
    iou_count: int


def _ring(geom: Geom) -> list[tuple[float, float]]:
    """Ring vertices; a bbox gives its corners (x1,y1),(x2,y1),(x2,y2),(x1,y2) (§8.2 step 4)."""
    geom_type, bins = geom
    if geom_type == "bbox_2d":
        if len(bins) != 4:
            raise ValueError(f"bbox_2d geometry needs 4 bins, got {len(bins)}: {list(bins)}")
        x1, y1, x2, y2 = bins
        return [(x1, y1), (x2, y1), (x2, y2), (x1, y2)]
    if geom_type == "poly":
        if len(bins) % 2:
            raise ValueError(f"poly geometry needs an even number of bins, got {len(bins)}")
        return list(zip(bins[0::2], bins[1::2], strict=True))
    raise ValueError(f"unknown geom_type {geom_type!r}; expected 'bbox_2d' or 'poly'")


def aabb(geom: Geom) -> tuple[float, float, float, float]:
    """Axis-aligned box ``(min x, min y, max x, max y)`` of a geometry (§8.2 step 2)."""
    geom_type, bins = geom
    if geom_type == "bbox_2d":
        if len(bins) != 4:
            raise ValueError(f"bbox_2d geometry needs 4 bins, got {len(bins)}: {list(bins)}")
        x1, y1, x2, y2 = bins
        return (float(min(x1, x2)), float(min(y1, y2)), float(max(x1, x2)), float(max(y1, y2)))
    if geom_type != "poly":
        raise ValueError(f"unknown geom_type {geom_type!r}; expected 'bbox_2d' or 'poly'")
    if len(bins) % 2:
        raise ValueError(f"poly geometry needs an even number of bins, got {len(bins)}")
    if not bins:
        return (0.0, 0.0, 0.0, 0.0)
    xs, ys = bins[0::2], bins[1::2]
    return (float(min(xs)), float(min(ys)), float(max(xs)), float(max(ys)))


def _aabbs(geoms: Sequence[Geom]) -> np.ndarray:
    return np.array([aabb(g) for g in geoms], dtype=np.float64).reshape(-1, 4)


def aabb_iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of sorted boxes ``a [P, 4]`` and ``b [G, 4]`` with continuous areas; zero union → 0."""
    ix1 = np.maximum(a[:, None, 0], b[None, :, 0])
    iy1 = np.maximum(a[:, None, 1], b[None, :, 1])
    ix2 = np.minimum(a[:, None, 2], b[None, :, 2])
    iy2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(ix2 - ix1, 0.0, None) * np.clip(iy2 - iy1, 0.0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    out = np.zeros_like(inter)
    np.divide(inter, union, out=out, where=union > 0)
    return out


def aabb_iou(a: Geom, b: Geom) -> float:
    """AABB IoU of two geometries (§8.2 step 2)."""
    return float(aabb_iou_matrix(np.array([aabb(a)]), np.array([aabb(b)]))[0, 0])


def candidate_lists(pred_boxes: np.ndarray, gt_boxes: np.ndarray, top_k: int) -> np.ndarray:
    """GT candidates per prediction (§8.2 step 3), best first: ``[P, min(top_k, G)]`` GT indices.

    Rank GTs by AABB IoU descending; if a prediction's best AABB IoU is 0, rank by squared center
    distance ascending instead. Ties: lower GT index first (stable sorts). Keep the first ``top_k``.
    """
    iou = aabb_iou_matrix(pred_boxes, gt_boxes)
    k = min(top_k, gt_boxes.shape[0])
    by_iou = np.argsort(-iou, axis=1, kind="stable")[:, :k]
    pc = (pred_boxes[:, :2] + pred_boxes[:, 2:]) / 2.0
    gc = (gt_boxes[:, :2] + gt_boxes[:, 2:]) / 2.0
    d2 = ((pc[:, None, :] - gc[None, :, :]) ** 2).sum(axis=2)
    by_dist = np.argsort(d2, axis=1, kind="stable")[:, :k]
    use_dist = iou.max(axis=1) <= 0.0
    return np.where(use_dist[:, None], by_dist, by_iou)


def _shapes(geoms: Sequence[Geom]) -> tuple[np.ndarray, np.ndarray]:
    """Polygonal shapely geometries (clamped to [0, 999], repaired when invalid) and their areas.

    One vectorized construction for all rings; a ring that GEOS rejects (fewer than 3 points) is None
    with area 0.
    """
    rings = [_ring(g) for g in geoms]
    out = np.full(len(geoms), None, dtype=object)
    keep = [k for k, r in enumerate(rings) if len(r) >= 3]
    if keep:
        coords = np.clip(np.array([pt for k in keep for pt in rings[k]], dtype=np.float64), 0.0, 999.0)
        index = np.repeat(np.arange(len(keep)), [len(rings[k]) for k in keep])
        try:
            out[keep] = shapely.polygons(shapely.linearrings(coords, indices=index))
        except (shapely.errors.GEOSException, ValueError):
            for k in keep:  # isolate the bad ring(s)
                try:
                    out[k] = shapely.Polygon(np.clip(np.array(rings[k], dtype=np.float64), 0.0, 999.0))
                except (shapely.errors.GEOSException, ValueError):
                    out[k] = None
    present = np.array([o is not None for o in out], dtype=bool)
    areas = np.zeros(len(geoms))
    if present.any():
        sub = out[present]
        bad = ~shapely.is_valid(sub)
        if bad.any():
            # Self-intersecting rings: even-odd repair (linework), as COCO's rasterizer fills them.
            sub[bad] = shapely.make_valid(sub[bad])
            out[present] = sub
        areas[present] = shapely.area(sub)
    return out, areas


def _pair_iou(a: object, b: object, area_a: float, area_b: float) -> float:
    """Exact IoU of two prepared shapes; any geometry error → 0 (§8.2 step 4)."""
    if a is None or b is None:
        return 0.0
    try:
        inter = float(shapely.area(shapely.intersection(a, b)))
    except shapely.errors.GEOSException:
        logger.debug("maskIoU: GEOS error, IoU set to 0", exc_info=True)
        return 0.0
    union = area_a + area_b - inter
    return inter / union if union > 0 and np.isfinite(inter) else 0.0


def mask_iou(a: Geom, b: Geom, resolution: int = 256) -> float:
    """Exact polygon IoU of two geometries clamped to [0, 999] (see module docstring).

    Args:
        a: first geometry ``(geom_type, bins)``.
        b: second geometry.
        resolution: raster size of the reference definition; unused (IoU is scale-invariant).

    Returns:
        IoU in [0, 1]; 0 for fewer than 3 points, zero union or a geometry error.
    """
    del resolution
    shapes, areas = _shapes([a, b])
    return _pair_iou(shapes[0], shapes[1], areas[0], areas[1])


def mask_iou_pairs(
    preds: Sequence[Geom],
    gts: Sequence[Geom],
    pairs: np.ndarray,
    gate: float,
    pred_boxes: np.ndarray | None = None,
    gt_boxes: np.ndarray | None = None,
) -> np.ndarray:
    """maskIoU for candidate pairs ``pairs [N, 2]`` (pred index, GT index).

    ``pred_boxes`` / ``gt_boxes`` are the AABBs ``[N, 4]`` when the caller already has them.

    Values at or above ``gate`` are exact. A value below ``gate`` may be reported as 0 when an upper
    bound already rules the pair out (intersection ≤ min(AABB overlap, area_a, area_b)), which saves
    the exact polygon intersection; the gate decision is the same either way.
    """
    n = pairs.shape[0]
    out = np.zeros(n)
    if n == 0:
        return out
    pb = (_aabbs(preds) if pred_boxes is None else pred_boxes).clip(0.0, 999.0)
    gb = (_aabbs(gts) if gt_boxes is None else gt_boxes).clip(0.0, 999.0)
    pi, gj = pairs[:, 0], pairs[:, 1]
    ix = np.clip(np.minimum(pb[pi, 2], gb[gj, 2]) - np.maximum(pb[pi, 0], gb[gj, 0]), 0.0, None)
    iy = np.clip(np.minimum(pb[pi, 3], gb[gj, 3]) - np.maximum(pb[pi, 1], gb[gj, 1]), 0.0, None)
    box_inter = ix * iy
    p_box = np.array([t == "bbox_2d" for t, _ in preds], dtype=bool)
    g_box = np.array([t == "bbox_2d" for t, _ in gts], dtype=bool)
    both_bbox = p_box[pi] & g_box[gj]
    if both_bbox.any():
        # Rectangle rings: the polygon IoU is the AABB IoU of the clamped boxes.
        pa = (pb[pi, 2] - pb[pi, 0]) * (pb[pi, 3] - pb[pi, 1])
        ga = (gb[gj, 2] - gb[gj, 0]) * (gb[gj, 3] - gb[gj, 1])
        union = pa + ga - box_inter
        ok = both_bbox & (union > 0)
        out[ok] = box_inter[ok] / union[ok]
    need = ~both_bbox & (box_inter > 0.0)
    if not need.any():
        return out
    used_p, p_loc = np.unique(pi[need], return_inverse=True)
    used_g, g_loc = np.unique(gj[need], return_inverse=True)
    ps, pa = _shapes([preds[i] for i in used_p.tolist()])
    gs, ga = _shapes([gts[j] for j in used_g.tolist()])
    idx = np.flatnonzero(need)
    area_a, area_b = pa[p_loc], ga[g_loc]
    bound_inter = np.minimum(np.minimum(box_inter[idx], area_a), area_b)
    denom = area_a + area_b - bound_inter
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.where(denom > 0, bound_inter / denom, 0.0)
    # The margin keeps float rounding of the bound from skipping a pair whose exact IoU is the gate.
    todo = (bound >= gate - 1e-9) & (area_a > 0) & (area_b > 0)
    if not todo.any():
        return out
    idx, p_loc, g_loc = idx[todo], p_loc[todo], g_loc[todo]
    area_a, area_b = area_a[todo], area_b[todo]
    try:
        inter = shapely.area(shapely.intersection(ps[p_loc], gs[g_loc]))
    except shapely.errors.GEOSException:
        # One bad pair must not zero the others: redo pair by pair (each error → IoU 0).
        out[idx] = [
            _pair_iou(ps[a], gs[b], fa, fb)
            for a, b, fa, fb in zip(p_loc.tolist(), g_loc.tolist(), area_a, area_b, strict=True)
        ]
        return out
    union = area_a + area_b - inter
    good = (union > 0) & np.isfinite(inter)
    out[idx[good]] = inter[good] / union[good]
    return out


def pred_geoms(
    valid_objects: Sequence[Any], response_token_ids: Sequence[int], coord_vocab: CoordVocab
) -> list[Geom]:
    """Prediction geometries of §8.1: bins read from the token ids at ``coord_token_indices``.

    Args:
        valid_objects: ``ParseResult.valid_objects`` (``geom_type``, ``coord_token_indices``).
        response_token_ids: ``ParseResult.response_token_ids``.
        coord_vocab: coord id → bin map.
    """
    bin_of = coord_vocab.bin_of
    return [
        (o.geom_type, tuple(bin_of(response_token_ids[i]) for i in o.coord_token_indices))
        for o in valid_objects
    ]


def gt_geoms(gts: Sequence[Any]) -> list[Geom]:
    """GT geometries ``(geom_type, bins)`` of well-formed GT objects, in GT order."""
    return [(g.geom_type, tuple(g.bins)) for g in gts]


def _assign(feasible: np.ndarray, ious: np.ndarray, cfg: MatchingConfig) -> list[tuple[int, int, float]]:
    """Dummy-augmented linear assignment (§8.2 step 6) over the gate-passing pairs.

    Only predictions and GTs with at least one feasible pair enter the matrix: the others are unmatched
    whatever the solver does, and leaving them out gives the same optimum on a smaller problem.

    Returns:
        Matched ``(pred, gt, maskIoU)`` sorted by prediction.
    """
    if feasible.shape[0] == 0:
        return []
    rows_p, loc_p = np.unique(feasible[:, 0], return_inverse=True)
    cols_g, loc_g = np.unique(feasible[:, 1], return_inverse=True)
    n_p, n_g = len(rows_p), len(cols_g)
    cost = np.full((n_p + n_g, n_p + n_g), INFEASIBLE)
    cost[loc_p, loc_g] = 1.0 - ious
    cost[:n_p, n_g:] = cfg.fp_cost
    cost[n_p:, :n_g] = cfg.fn_cost
    cost[n_p:, n_g:] = 0.0
    iou = np.zeros((n_p, n_g))
    iou[loc_p, loc_g] = ious
    rows, cols = linear_sum_assignment(cost)
    matched = [
        (int(rows_p[r]), int(cols_g[c]), float(iou[r, c]))
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True)
        if r < n_p and c < n_g and cost[r, c] < _MATCH_COST_LIMIT
    ]
    return sorted(matched)


def match(preds: Sequence[Geom], gts: Sequence[Geom], cfg: MatchingConfig) -> MatchResult:
    """Match predictions to GT objects (§8.2).

    Args:
        preds: geometries of the valid predictions, in appearance order.
        gts: geometries of the well-formed GT objects, in GT order.
        cfg: matching knobs.

    Returns:
        A :class:`MatchResult`; indices refer to positions in ``preds`` / ``gts``.
    """
    n_p, n_g = len(preds), len(gts)
    if n_p == 0 or n_g == 0:
        return MatchResult((), tuple(range(n_p)), tuple(range(n_g)), 0, 0, 0.0, 0)
    pred_boxes, gt_boxes = _aabbs(preds), _aabbs(gts)
    cands = candidate_lists(pred_boxes, gt_boxes, cfg.candidate_top_k)
    pairs = np.stack([np.repeat(np.arange(n_p), cands.shape[1]), cands.ravel()], axis=1).astype(np.int64)
    ious = mask_iou_pairs(preds, gts, pairs, cfg.maskiou_gate, pred_boxes, gt_boxes)
    passed = ious >= cfg.maskiou_gate
    matched = _assign(pairs[passed], ious[passed], cfg)
    mp = {p for p, _, _ in matched}
    mg = {g for _, g, _ in matched}
    return MatchResult(
        pairs=tuple(matched),
        fp=tuple(i for i in range(n_p) if i not in mp),
        fn=tuple(j for j in range(n_g) if j not in mg),
        gating_rejections=int((~passed).sum()),
        candidate_pairs=int(pairs.shape[0]),
        iou_sum=float(sum(v for _, _, v in matched)),
        iou_count=len(matched),
    )

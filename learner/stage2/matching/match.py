"""Hungarian matching of valid predictions to GT objects (docs/ALGORITHM.md#matching).

Geometries are ``(geom_type, bins)`` with ``geom_type`` in ``{"bbox_2d", "poly"}`` and ``bins`` a flat
sequence of norm1000 integers (bbox: ``x1, y1, x2, y2``; poly: ``x0, y0, x1, y1, ...``). ``desc`` plays
no part. All indices in a :class:`MatchResult` are 0-based positions in the prediction / GT lists passed
to :func:`match`.

maskIoU (§8.2 step 4) is the exact polygon IoU of ``maskiou.py`` (see its docstring for the choice and the
per-pair-kind fast paths); ``resolution`` is accepted only for interface compatibility.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import Field
from scipy.optimize import linear_sum_assignment

from learner.stage2.coords import CoordVocab
from learner.stage2.matching.maskiou import Geom, aabb, geom_table, mask_iou, mask_iou_pairs, pair_ious
from shared_schemas.config import ConfigSection

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

INFEASIBLE = 1e6
"""Cost of a non-candidate or gated-out pair (finite so the solver always succeeds)."""
_MATCH_COST_LIMIT = 5e5


class MatchingConfig(ConfigSection):
    """``stage2.matching.*`` knobs (§8.2)."""

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


def aabb_iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of sorted boxes ``a [P, 4]`` and ``b [G, 4]`` with continuous areas; zero union → 0."""
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    side = np.clip(hi - lo, 0.0, None)  # overlap width and height, x and y together
    inter = side[:, :, 0] * side[:, :, 1]
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
    out = np.argsort(-iou, axis=1, kind="stable")[:, :k]
    use_dist = iou.max(axis=1) <= 0.0
    if use_dist.any():  # usually a few predictions at most: rank only those by distance
        pb = pred_boxes[use_dist]
        pc = (pb[:, :2] + pb[:, 2:]) / 2.0
        gc = (gt_boxes[:, :2] + gt_boxes[:, 2:]) / 2.0
        dx = pc[:, None, 0] - gc[None, :, 0]
        dy = pc[:, None, 1] - gc[None, :, 1]
        out[use_dist] = np.argsort(dx * dx + dy * dy, axis=1, kind="stable")[:, :k]
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


def _compact(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` for small ints >= 0 via a presence table (no sort)."""
    present = np.zeros(int(values.max()) + 1, dtype=bool)
    present[values] = True
    return np.flatnonzero(present), (np.cumsum(present) - 1)[values]


def _assign(feasible: np.ndarray, ious: np.ndarray, cfg: MatchingConfig) -> list[tuple[int, int, float]]:
    """Dummy-augmented linear assignment (§8.2 step 6) over the gate-passing pairs.

    Only predictions and GTs with at least one feasible pair enter the matrix: the others are unmatched
    whatever the solver does, and leaving them out gives the same optimum on a smaller problem.

    Returns:
        Matched ``(pred, gt, maskIoU)`` sorted by prediction.
    """
    if feasible.shape[0] == 0:
        return []
    rows_p, loc_p = _compact(feasible[:, 0])
    cols_g, loc_g = _compact(feasible[:, 1])
    n_p, n_g = len(rows_p), len(cols_g)
    cost = np.full((n_p + n_g, n_p + n_g), INFEASIBLE)
    cost[loc_p, loc_g] = 1.0 - ious
    cost[:n_p, n_g:] = cfg.fp_cost
    cost[n_p:, :n_g] = cfg.fn_cost
    cost[n_p:, n_g:] = 0.0
    iou = np.zeros((n_p, n_g))
    iou[loc_p, loc_g] = ious
    rows, cols = linear_sum_assignment(cost)
    real = (rows < n_p) & (cols < n_g)
    rows, cols = rows[real], cols[real]
    take = cost[rows, cols] < _MATCH_COST_LIMIT
    rows, cols = rows[take], cols[take]
    matched = zip(rows_p[rows].tolist(), cols_g[cols].tolist(), iou[rows, cols].tolist(), strict=True)
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
    table = geom_table([*preds, *gts])  # one table: predictions first, then GTs
    cands = candidate_lists(table.boxes[:n_p], table.boxes[n_p:], cfg.candidate_top_k)
    pairs = np.stack([np.repeat(np.arange(n_p), cands.shape[1]), cands.ravel()], axis=1).astype(np.int64)
    ious = pair_ious(table, pairs[:, 0], n_p + pairs[:, 1], cfg.maskiou_gate)
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

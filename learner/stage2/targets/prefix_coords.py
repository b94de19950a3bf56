"""§9 prefix coordinate targets (docs/ALGORITHM.md#prefix-targets): the coordinate bins a matched prediction
is taught — the GT's own bins for box ↔ box, else the Sinkhorn barycentric projection of the GT onto the
prediction's points, rounded half-to-even and clamped to 0..999."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from learner.stage2.matching.match import Geom
from learner.stage2.targets.ot import barycentric_padded

if TYPE_CHECKING:
    from learner.stage2.targets.y_train import TargetsConfig

__all__ = ["prefix_coord_targets", "prefix_coord_targets_batch"]


def _pts(geom: Geom) -> list[tuple[float, float]]:
    """Point set of a geometry: poly vertices, or a bbox's corners (x1,y1),(x2,y1),(x2,y2),(x1,y2)."""
    geom_type, bins = geom
    if geom_type == "bbox_2d":
        if len(bins) != 4:
            raise ValueError(f"bbox_2d needs 4 bins, got {len(bins)}")
        x1, y1, x2, y2 = bins
        return [(x1, y1), (x2, y1), (x2, y2), (x1, y2)]
    if geom_type == "poly" and len(bins) % 2 == 0:
        return list(zip(bins[0::2], bins[1::2], strict=True))
    raise ValueError(f"bad geometry {geom_type!r} with {len(bins)} bins")


_BIN_OF = {k: k for k in range(1000)}
"""``_clamped_bin`` of every value equal to an int 0..999, by lookup (float 5.0 hashes and compares as 5)."""


def _clamped_bin(v: float) -> int:
    # round() is half-to-even, as §9 requires; raises on NaN / inf (→ pair excluded).
    return min(999, max(0, int(round(v))))


def _int_rows(values: np.ndarray, ok: np.ndarray) -> list[list[int]]:
    """Rows of ``values`` as Python int lists; rows where ``ok`` is False, and non-finite entries, read 0."""
    return np.where(ok[:, None] & np.isfinite(values), values, 0.0).astype(np.int64).tolist()


def _box_targets(proj: np.ndarray, ns: list[int], ok: np.ndarray) -> list[list[int]]:
    """Per pair, ``[min x, min y, max x, max y]`` of the projected points, rounded, clamped (§9 bbox pred)."""
    with np.errstate(invalid="ignore"):
        real = np.arange(proj.shape[1])[None, :, None] < np.array(ns)[:, None, None]
        lo = np.rint(np.where(real, proj, np.inf).min(axis=1)).clip(0, 999)
        hi = np.rint(np.where(real, proj, -np.inf).max(axis=1)).clip(0, 999)
    return _int_rows(np.concatenate([lo, hi], 1), ok)


def prefix_coord_targets_batch(
    pairs: Sequence[tuple[Geom, Geom]], cfg: TargetsConfig
) -> list[list[int] | None]:
    """§9 targets for many ``(pred_geom, gt_geom)`` pairs; one Sinkhorn batch for all OT pairs.

    Returns:
        Per pair, one target bin per coord slot of the prediction (bbox: 4; poly: its flat length),
        or None on failure (bad geometry, non-finite value, wrong length).
    """
    out: list[list[int] | None] = [None] * len(pairs)
    ot_idx: list[int] = []
    ot_p: list[list[tuple[float, float]]] = []
    ot_g: list[list[tuple[float, float]]] = []
    for k, (pred, gt) in enumerate(pairs):
        try:
            if pred[0] == "bbox_2d" and gt[0] == "bbox_2d" and len(gt[1]) == 4:
                try:  # integral values in 0..999 (the common case) map to themselves as ints
                    out[k] = list(map(_BIN_OF.__getitem__, gt[1]))
                except (KeyError, TypeError):
                    out[k] = [_clamped_bin(v) for v in gt[1]]
                continue
            p, g = _pts(pred), _pts(gt)
        except (ValueError, TypeError, OverflowError):
            continue  # malformed geometry or non-finite value → excluded from supervision
        if p and g:
            ot_idx.append(k)
            ot_p.append(p)
            ot_g.append(g)
    if ot_idx:
        proj, ok, ns = barycentric_padded(
            ot_p, ot_g, cost=cfg.ot_cost, epsilon=cfg.ot_epsilon, iters=cfg.ot_iters
        )
        with np.errstate(invalid="ignore"):
            rounded = np.clip(np.rint(proj), 0, 999)  # np.rint is half-to-even
        # Only usable pairs are read (all their real values are finite), as Python ints, in one conversion.
        rounded_l = _int_rows(rounded.reshape(len(ns), -1), ok)
        box_l = _box_targets(proj, ns, ok) if any(pairs[k][0][0] == "bbox_2d" for k in ot_idx) else []
        for b, k in enumerate(ot_idx):
            if not ok[b]:
                continue
            out[k] = box_l[b] if pairs[k][0][0] == "bbox_2d" else rounded_l[b][: 2 * ns[b]]
    for k, (pred, _) in enumerate(pairs):
        if out[k] is not None and len(out[k]) != len(pred[1]):
            out[k] = None
    return out


def prefix_coord_targets(pred_geom: Geom, gt_geom: Geom, cfg: TargetsConfig) -> list[int] | None:
    """§9 targets for one matched pair: GT bins for bbox↔bbox, else Sinkhorn barycentric projection.

    Args:
        pred_geom: prediction ``(geom_type, bins)``.
        gt_geom: GT ``(geom_type, bins)``.
        cfg: OT knobs.

    Returns:
        One bin (0..999) per coord slot of the prediction, or None when target building fails.
    """
    return prefix_coord_targets_batch([(pred_geom, gt_geom)], cfg)[0]

"""Entropic optimal transport barycentric projection for prefix coord targets (spec/STAGE2.md §9).

Exactly the §9 formulas, float64 numpy, stop-gradient by construction (no torch):

    C[i, j] = ||p_i - g_j||_2 (l2)  or  |dx| + |dy| (l1)            # norm1000 units
    K = exp(clip(-C / eps, -50, 50)); a = 1/n; b = 1/m; u = 1_n; v = 1_m
    repeat iters:  u = a / max(K v, 1e-300);  v = b / max(K^T u, 1e-300)
    T = diag(u) K diag(v);  g_hat_i = sum_j T[i, j] g_j / sum_j T[i, j]

:func:`barycentric_batch` runs many pairs at once by zero-padding to ``[B, n_max, m_max]``: padded
rows/columns carry zero mass (``a``, ``b`` and ``K`` are 0 there), so the real entries see the same sums
as the unpadded problem (adding exact zeros), and the per-pair Python overhead is paid once per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["barycentric_batch", "barycentric_padded", "barycentric_projection"]

_CLIP = 50.0
_TINY = 1e-300


def _padded(sets: Sequence[ArrayLike], sizes: np.ndarray, live: np.ndarray, n_max: int) -> np.ndarray:
    """Zero-padded ``[B, n_max, 2]`` array of the point sets of the live pairs (one vectorized scatter)."""
    out = np.zeros((len(sizes), n_max, 2))
    if sets:
        flat = np.array([pt for s in sets for pt in s], dtype=np.float64).reshape(-1, 2)
        batch = np.repeat(np.flatnonzero(live), sizes[live])
        ends = np.cumsum(sizes[live])
        row = np.arange(len(flat)) - np.repeat(ends - sizes[live], sizes[live])
        out[batch, row] = flat
    return out


def barycentric_padded(
    preds: Sequence[ArrayLike],
    gts: Sequence[ArrayLike],
    *,
    cost: Literal["l1", "l2"],
    epsilon: float,
    iters: int,
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Batched projection on zero-padded arrays.

    Args:
        preds: per pair, prediction points ``[n, 2]`` (norm1000).
        gts: per pair, GT points ``[m, 2]``.
        cost: ``"l2"`` (Euclidean) or ``"l1"`` (Manhattan) point distance.
        epsilon: entropic regularization (> 0).
        iters: Sinkhorn iterations (>= 1).

    Returns:
        ``(proj [B, n_max, 2], ok [B], ns)``: projected points (rows ``>= ns[k]`` are padding),
        whether pair ``k`` is usable (every real row finite with positive plan mass, ``n, m > 0``),
        and the number of prediction points per pair.
    """
    if len(preds) != len(gts):
        raise ValueError(f"barycentric_padded: {len(preds)} prediction sets vs {len(gts)} GT sets")
    if epsilon <= 0 or iters < 1:
        raise ValueError(f"barycentric_padded: need epsilon > 0 and iters >= 1, got {epsilon}, {iters}")
    if cost not in ("l1", "l2"):
        raise ValueError(f"unknown ot_cost {cost!r}; expected 'l1' or 'l2'")
    bsz = len(preds)
    ns = [len(p) for p in preds]
    ms = [len(g) for g in gts]
    n_max, m_max = max(ns, default=0), max(ms, default=0)
    if bsz == 0 or n_max == 0 or m_max == 0:
        return np.zeros((bsz, n_max, 2)), np.zeros(bsz, dtype=bool), ns
    n_arr, m_arr = np.array(ns), np.array(ms)
    live = (n_arr > 0) & (m_arr > 0)
    pp = _padded([p for k, p in enumerate(preds) if live[k]], n_arr, live, n_max)
    gg = _padded([g for k, g in enumerate(gts) if live[k]], m_arr, live, m_max)
    row_real = np.arange(n_max)[None, :] < n_arr[:, None]
    col_real = np.arange(m_max)[None, :] < m_arr[:, None]
    with np.errstate(divide="ignore"):
        a = np.where(row_real & live[:, None], 1.0 / np.maximum(n_arr, 1)[:, None], 0.0)
        b = np.where(col_real & live[:, None], 1.0 / np.maximum(m_arr, 1)[:, None], 0.0)
    d = pp[:, :, None, :] - gg[:, None, :, :]
    c = np.sqrt((d * d).sum(axis=-1)) if cost == "l2" else np.abs(d).sum(axis=-1)
    kern = np.exp(np.clip(-c / epsilon, -_CLIP, _CLIP))
    kern *= (a > 0)[:, :, None] & (b > 0)[:, None, :]  # padding carries no mass
    kern_t = kern.transpose(0, 2, 1)
    u = (a > 0).astype(np.float64)
    v = (b > 0).astype(np.float64)
    with np.errstate(all="ignore"):
        for _ in range(iters):
            u = a / np.maximum(np.matmul(kern, v[:, :, None])[:, :, 0], _TINY)
            v = b / np.maximum(np.matmul(kern_t, u[:, :, None])[:, :, 0], _TINY)
        plan = u[:, :, None] * kern * v[:, None, :]
        mass = plan.sum(axis=2)
        proj = np.matmul(plan, gg) / mass[:, :, None]
        row_ok = np.isfinite(proj).all(axis=2) & (mass > 0)
    ok = live & (row_ok | ~row_real).all(axis=1)
    return proj, ok, ns


def barycentric_batch(
    preds: Sequence[ArrayLike],
    gts: Sequence[ArrayLike],
    *,
    cost: Literal["l1", "l2"],
    epsilon: float,
    iters: int,
) -> list[np.ndarray | None]:
    """Project each prediction point set onto its GT point set.

    Args:
        preds: per pair, prediction points ``[n, 2]`` (norm1000, float).
        gts: per pair, GT points ``[m, 2]``.
        cost: ``"l2"`` (Euclidean) or ``"l1"`` (Manhattan) point distance.
        epsilon: entropic regularization (> 0).
        iters: Sinkhorn iterations (>= 1).

    Returns:
        Per pair, the projected points ``[n, 2]`` (float64, unrounded), or None when a value is
        non-finite or a row of the plan has zero mass (the caller excludes the pair, §9).
    """
    proj, ok, ns = barycentric_padded(preds, gts, cost=cost, epsilon=epsilon, iters=iters)
    return [proj[k, : ns[k]].copy() if ok[k] else None for k in range(len(ns))]


def barycentric_projection(
    pred_pts: np.ndarray,
    gt_pts: np.ndarray,
    *,
    cost: Literal["l1", "l2"] = "l2",
    epsilon: float = 10.0,
    iters: int = 30,
) -> np.ndarray | None:
    """Single-pair form of :func:`barycentric_batch`."""
    return barycentric_batch([pred_pts], [gt_pts], cost=cost, epsilon=epsilon, iters=iters)[0]

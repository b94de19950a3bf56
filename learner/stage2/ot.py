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

__all__ = ["barycentric_batch", "barycentric_projection"]

_CLIP = 50.0
_TINY = 1e-300


def barycentric_batch(
    preds: Sequence[np.ndarray],
    gts: Sequence[np.ndarray],
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
    if len(preds) != len(gts):
        raise ValueError(f"barycentric_batch: {len(preds)} prediction sets vs {len(gts)} GT sets")
    if epsilon <= 0 or iters < 1:
        raise ValueError(f"barycentric_batch: need epsilon > 0 and iters >= 1, got {epsilon}, {iters}")
    bsz = len(preds)
    if bsz == 0:
        return []
    ns = [len(p) for p in preds]
    ms = [len(g) for g in gts]
    out: list[np.ndarray | None] = [None] * bsz
    n_max, m_max = max(ns), max(ms)
    if n_max == 0 or m_max == 0:
        return out
    pp = np.zeros((bsz, n_max, 2))
    gg = np.zeros((bsz, m_max, 2))
    a = np.zeros((bsz, n_max))
    b = np.zeros((bsz, m_max))
    for k, (p, g) in enumerate(zip(preds, gts, strict=True)):
        n, m = ns[k], ms[k]
        if n == 0 or m == 0:
            continue
        pp[k, :n] = p
        gg[k, :m] = g
        a[k, :n] = 1.0 / n
        b[k, :m] = 1.0 / m
    d = pp[:, :, None, :] - gg[:, None, :, :]
    if cost == "l2":
        c = np.sqrt((d * d).sum(axis=-1))
    elif cost == "l1":
        c = np.abs(d).sum(axis=-1)
    else:
        raise ValueError(f"unknown ot_cost {cost!r}; expected 'l1' or 'l2'")
    kern = np.exp(np.clip(-c / epsilon, -_CLIP, _CLIP))
    kern *= (a > 0)[:, :, None] & (b > 0)[:, None, :]  # padding carries no mass
    kern_t = kern.transpose(0, 2, 1)
    u = (a > 0).astype(np.float64)
    v = (b > 0).astype(np.float64)
    with np.errstate(all="ignore"):
        for _ in range(iters):
            u = a / np.maximum(np.einsum("bij,bj->bi", kern, v), _TINY)
            v = b / np.maximum(np.einsum("bji,bi->bj", kern_t, u), _TINY)
        plan = u[:, :, None] * kern * v[:, None, :]
        mass = plan.sum(axis=2)
        proj = np.einsum("bij,bjc->bic", plan, gg) / mass[:, :, None]
    for k in range(bsz):
        n = ns[k]
        if n == 0 or ms[k] == 0:
            continue
        r = proj[k, :n]
        if np.all(np.isfinite(r)) and np.all(mass[k, :n] > 0):
            out[k] = r.copy()
    return out


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

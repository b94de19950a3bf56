"""Entropic optimal transport barycentric projection for prefix coord targets
(docs/ALGORITHM.md#prefix-targets).

Exactly the §9 formulas, float64 numpy, stop-gradient by construction (no torch):

    C[i, j] = ||p_i - g_j||_2 (l2)  or  |dx| + |dy| (l1)            # norm1000 units
    K = exp(clip(-C / eps, -50, 50)); a = 1/n; b = 1/m; u = 1_n; v = 1_m
    repeat iters:  u = a / max(K v, 1e-300);  v = b / max(K^T u, 1e-300)
    T = diag(u) K diag(v);  g_hat_i = sum_j T[i, j] g_j / sum_j T[i, j]

:func:`barycentric_batch` runs many pairs at once by zero-padding to ``[B, n_max, m_max]``: padded
rows/columns carry zero mass (``a`` and ``b`` are 0 there), so the real entries see the same sums as the
unpadded problem (adding exact zeros), and the per-pair Python overhead is paid once per batch. The
iterations run on preallocated buffers without the ``max`` (see :func:`_sinkhorn` for why the results are
bit-identical to the formula above; ``tests/unit/learner/test_ot.py`` checks it).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["barycentric_batch", "barycentric_padded", "barycentric_projection"]

_CLIP = 50.0


def _padded(sets: Sequence[ArrayLike], real: np.ndarray) -> np.ndarray:
    """Zero-padded ``[B, n_max, 2]`` array of the point sets of the live pairs, ``sets`` in order.

    ``real [B, n_max]`` marks the rows that hold points; in row-major order they are exactly the points of
    ``sets`` one pair after the other, so one masked assignment scatters them.
    """
    out = np.zeros(real.shape + (2,))
    if sets:
        if any(isinstance(s, np.ndarray) for s in sets):
            flat = np.concatenate([np.asarray(s, dtype=np.float64).reshape(-1, 2) for s in sets])
        else:  # nested sequences of (x, y): read in one pass without per-point arrays
            chain = itertools.chain.from_iterable
            flat = np.fromiter(chain(chain(sets)), np.float64).reshape(-1, 2)
        out[real] = flat
    return out


def _kernel(pp: np.ndarray, gg: np.ndarray, cost: str, epsilon: float) -> np.ndarray:
    """``K = exp(clip(-C / eps, -50, 50))`` of every padded point pair ``[B, n_max, m_max]``."""
    dx = pp[:, :, None, 0] - gg[:, None, :, 0]
    dy = pp[:, :, None, 1] - gg[:, None, :, 1]
    # Written out instead of a sum over a length-2 axis (slow in numpy); same two-term sums.
    c = np.sqrt(dx * dx + dy * dy) if cost == "l2" else np.abs(dx) + np.abs(dy)
    return np.exp(np.clip(-c / epsilon, -_CLIP, _CLIP))


def _sinkhorn(kern: np.ndarray, a: np.ndarray, b: np.ndarray, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """The §9 scaling iterations on a padded batch, in place on preallocated buffers; returns ``(u, v)``.

    ``kern`` holds the kernel on real entries and 1 on the padding of live pairs, ``a`` / ``b`` are 0 on
    padding. The ``max(., 1e-300)`` of §9 is not applied, and the results are bit-identical to the
    formula with it:

    - real entries: ``K`` lies in ``[e^-50, 1]`` (costs are >= 0, exponents clipped), and Sinkhorn keeps every
      ``v_j`` within ``[e^-50, e^50]`` (the scaling map is monotone and 1-homogeneous, so the iterates stay
      between two multiples of its fixed point, whose entries differ by at most the kernel's range ``e^50``),
      hence ``K v >= e^-100`` and likewise ``K^T u``: far above 1e-300 (NaN stays NaN either way);
    - padding: a padded row has kernel 1 against every column, so its ``K v`` is ``Σ v > 0`` and its
      ``u = 0 / (K v) = 0``, exactly the ``0 / 1e-300`` of the formula; a padded column likewise. A real entry
      sees padding only through products with ``u = 0`` or ``v = 0``: the same exact zeros as with kernel 0.

    That saves two of six numpy calls per iteration (the loop is dominated by per-call overhead). Pairs
    without points (all padding) produce NaN instead of 0 here; their projection is NaN (0 / 0) either way.
    """
    u = np.zeros(a.shape + (1,))
    v = np.where(b > 0, 1.0, 0.0)[:, :, None]
    ku = np.empty_like(u)
    kv = np.empty_like(v)
    kern_t = kern.transpose(0, 2, 1)
    a3, b3 = a[:, :, None], b[:, :, None]
    with np.errstate(all="ignore"):
        for _ in range(iters):
            np.divide(a3, np.matmul(kern, v, out=ku), out=u)
            np.divide(b3, np.matmul(kern_t, u, out=kv), out=v)
    return u[:, :, 0], v[:, :, 0]


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
    row_real = (np.arange(n_max)[None, :] < n_arr[:, None]) & live[:, None]
    col_real = (np.arange(m_max)[None, :] < m_arr[:, None]) & live[:, None]
    all_live = bool(live.all())
    pp = _padded(preds if all_live else [p for k, p in enumerate(preds) if live[k]], row_real)
    gg = _padded(gts if all_live else [g for k, g in enumerate(gts) if live[k]], col_real)
    a = np.where(row_real, 1.0 / np.maximum(n_arr, 1)[:, None], 0.0)
    b = np.where(col_real, 1.0 / np.maximum(m_arr, 1)[:, None], 0.0)
    real = row_real[:, :, None] & col_real[:, None, :]
    # Padding of a live pair gets kernel 1 (see _sinkhorn); a pair without points keeps 0 everywhere.
    kern = np.where(real, _kernel(pp, gg, cost, epsilon), live.astype(np.float64)[:, None, None])
    u, v = _sinkhorn(kern, a, b, iters)
    with np.errstate(all="ignore"):
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

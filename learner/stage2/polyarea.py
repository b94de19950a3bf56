"""Ring areas and ring-pair intersection areas in numpy: the fast path of ``maskiou.py`` (spec/STAGE2.md §8.2).

Rings are polygons given by their vertices (closing edge implied), concatenated in one ``[V, 2]`` array with a
per-ring vertex count. All coordinates must be >= 0 (maskIoU clamps them to [0, 999]).

Trapezoid decomposition: an edge ``e`` spans ``[lo_e, hi_e]`` in x and bounds the trapezoid between itself and
``y = 0``, signed ``s_e = ±1`` by its x direction. For a closed ring, ``w(x, y) = Σ_e s_e [x in e, 0 <= y < y_e(x)]``
is its winding number (up to a global sign), so for two rings

    ∫∫ w_A w_B = Σ_{e in A} Σ_{f in B} s_e s_f ∫_{[lo_e, hi_e] ∩ [lo_f, hi_f]} min(y_e(x), y_f(x)) dx,

a closed form per edge pair. For SIMPLE rings ``w = ±1`` inside and 0 outside, so ``|∫∫ w_A w_B| = area(A ∩ B)``:
the same value as a GEOS overlay up to float rounding, at a fraction of the cost. A self-intersecting ring has
winding numbers other than ±1 and maskIoU wants its even-odd repair: only rings that :func:`star_simple` proves
simple, or that GEOS calls valid, take this path.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Edges", "pair_intersection_areas", "ring_areas", "ring_edges", "star_simple"]


def _next_vertex(count: np.ndarray) -> np.ndarray:
    """Row of the next vertex along each ring (the last vertex of a ring wraps to its first)."""
    total = int(count.sum())
    nxt = np.arange(1, total + 1)
    ends = np.cumsum(count)
    filled = count > 0
    nxt[ends[filled] - 1] = (ends - count)[filled]
    return nxt


def _cartesian(n_a: np.ndarray, n_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All ``(i, j)`` with ``i < n_a[k]``, ``j < n_b[k]`` per group ``k``: ``(group, i, j)`` flat, groups in order."""
    tot = n_a * n_b
    group = np.repeat(np.arange(len(tot)), tot)
    local = np.arange(int(tot.sum())) - np.repeat(np.cumsum(tot) - tot, tot)
    nb = n_b[group]
    return group, local // nb, local % nb


def star_simple(xy: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per ring: True when its vertices go strictly around their mean exactly once, which makes it simple.

    Such a ring is star-shaped from the mean ``c``: edge ``i`` lies in the wedge between the rays through its two
    vertices, the wedges turn the same way, never overlap and close after one turn, so edges meet only at shared
    vertices and GEOS calls the polygon valid. Rings written in the canonical order of §2.4 (by angle around the
    vertex mean) almost always pass. The test is exact: it needs integral coordinates and uses
    ``n * v - Σ v`` (= ``n (v - c)``), whose cross products stay below 2**53 for coordinates up to 1e4 and fewer
    than 1000 vertices (other rings return False). False means "ask GEOS", not "invalid".
    """
    n_rings = len(count)
    ring_of = np.repeat(np.arange(n_rings), count)
    x, y = xy[:, 0], xy[:, 1]
    exact = (
        np.isfinite(x) & np.isfinite(y) & (x == np.round(x)) & (y == np.round(y)) & (np.abs(xy) <= 1e4).all(1)
    )
    ok = (count >= 3) & (count < 1000) & (np.bincount(ring_of, weights=~exact, minlength=n_rings) == 0)
    if not ok.any():
        return ok
    n = count[ring_of].astype(np.float64)
    px = np.where(exact, n * x - np.bincount(ring_of, weights=np.where(exact, x, 0.0))[ring_of], 0.0)
    py = np.where(exact, n * y - np.bincount(ring_of, weights=np.where(exact, y, 0.0))[ring_of], 0.0)
    nxt = _next_vertex(count)
    cross = px * py[nxt] - py * px[nxt]
    ccw = np.bincount(ring_of, weights=cross > 0, minlength=n_rings) == count
    cw = np.bincount(ring_of, weights=cross < 0, minlength=n_rings) == count
    ok &= ccw | cw
    # Every step turns by an angle in (0, pi) the same way; the turns must add up to exactly one full turn
    # (the float sum is within ~1e-12 of a multiple of 2 pi, so rounding finds the multiple exactly).
    angle = np.arctan2(py, px)
    step = np.mod(np.where(ccw[ring_of], angle[nxt] - angle, angle - angle[nxt]), 2 * np.pi)
    turns = np.round(np.bincount(ring_of, weights=step, minlength=n_rings) / (2 * np.pi))
    return ok & (turns == 1)


class Edges(NamedTuple):
    """The non-vertical edges of a ring list; ring ``r`` owns rows ``off[r] : off[r] + num[r]``.

    Attributes:
        lo: left x of each edge.
        hi: right x (``hi > lo``).
        ylo: y at ``lo``.
        yhi: y at ``hi``.
        sign: +1 for an edge running towards +x, -1 otherwise.
        off: first row of each ring.
        num: edges of each ring.
    """

    lo: np.ndarray
    hi: np.ndarray
    ylo: np.ndarray
    yhi: np.ndarray
    sign: np.ndarray
    off: np.ndarray
    num: np.ndarray


def ring_edges(xy: np.ndarray, count: np.ndarray) -> Edges:
    """Edge table of the rings ``xy`` (ring ``r`` = the next ``count[r]`` rows); vertical edges add no area."""
    nxt = _next_vertex(count)
    x0, y0 = xy[:, 0], xy[:, 1]
    x1, y1 = x0[nxt], y0[nxt]
    keep = x0 != x1
    rightward = x0 < x1
    num = np.bincount(np.repeat(np.arange(len(count)), count)[keep], minlength=len(count))
    return Edges(
        lo=np.minimum(x0, x1)[keep],
        hi=np.maximum(x0, x1)[keep],
        ylo=np.where(rightward, y0, y1)[keep],
        yhi=np.where(rightward, y1, y0)[keep],
        sign=np.where(rightward, 1.0, -1.0)[keep],
        off=np.cumsum(num) - num,
        num=num,
    )


def ring_areas(edges: Edges) -> np.ndarray:
    """Area of each SIMPLE ring (exact for integer coordinates: every term is a multiple of 1/2 below 2**52)."""
    ring = np.repeat(np.arange(len(edges.num)), edges.num)
    signed = edges.sign * (edges.hi - edges.lo) * (edges.ylo + edges.yhi) / 2.0
    return np.abs(np.bincount(ring, weights=signed, minlength=len(edges.num)))


def _y_at(lo: np.ndarray, hi: np.ndarray, ylo: np.ndarray, yhi: np.ndarray, x: np.ndarray) -> np.ndarray:
    # The fraction form is exact at both ends (x = lo gives ylo, x = hi gives yhi).
    return ylo + (yhi - ylo) * ((x - lo) / (hi - lo))


def pair_intersection_areas(
    ea: Edges, ring_a: np.ndarray, eb: Edges, ring_b: np.ndarray, y_ref: np.ndarray
) -> np.ndarray:
    """``area(A_k ∩ B_k)`` for the SIMPLE ring pairs ``A_k = ring_a[k]`` of ``ea``, ``B_k = ring_b[k]`` of ``eb``.

    Vectorized over all edge pairs of all ring pairs (see the module docstring). ``y_ref[k]`` is a height near
    the pair (e.g. the middle of its AABB overlap): the sum is invariant under a vertical shift (every vertical
    line crosses as many rightward as leftward edges), and measuring the trapezoids from there instead of from
    ``y = 0`` keeps the terms small, so their cancellation loses little precision.
    """
    n_pairs = len(ring_a)
    pair, i, j = _cartesian(ea.num[ring_a], eb.num[ring_b])
    ia = ea.off[ring_a][pair] + i
    ib = eb.off[ring_b][pair] + j
    xl = np.maximum(ea.lo[ia], eb.lo[ib])
    xr = np.minimum(ea.hi[ia], eb.hi[ib])
    live = xr > xl  # edge pairs whose x ranges overlap
    pair, ia, ib, xl, xr = pair[live], ia[live], ib[live], xl[live], xr[live]
    ref = y_ref[pair]
    a_lo, a_hi, a_ylo, a_yhi = ea.lo[ia], ea.hi[ia], ea.ylo[ia] - ref, ea.yhi[ia] - ref
    b_lo, b_hi, b_ylo, b_yhi = eb.lo[ib], eb.hi[ib], eb.ylo[ib] - ref, eb.yhi[ib] - ref
    ya_l, ya_r = _y_at(a_lo, a_hi, a_ylo, a_yhi, xl), _y_at(a_lo, a_hi, a_ylo, a_yhi, xr)
    yb_l, yb_r = _y_at(b_lo, b_hi, b_ylo, b_yhi, xl), _y_at(b_lo, b_hi, b_ylo, b_yhi, xr)
    d_l, d_r = ya_l - yb_l, ya_r - yb_r
    # min(ya, yb) = (ya + yb) / 2 - |ya - yb| / 2; |d| is linear between the ends unless d changes sign, where
    # its mean over the interval is (d_l² + d_r²) / (2 (|d_l| + |d_r|)).
    same = d_l * d_r >= 0.0
    abs_sum = np.abs(d_l) + np.abs(d_r)
    mean_abs = np.where(
        same, np.abs(d_l + d_r) / 2.0, (d_l * d_l + d_r * d_r) / (2.0 * np.where(same, 1.0, abs_sum))
    )
    mean_min = (ya_l + ya_r + yb_l + yb_r) / 4.0 - mean_abs / 2.0
    term = ea.sign[ia] * eb.sign[ib] * (xr - xl) * mean_min
    return np.abs(np.bincount(pair, weights=term, minlength=n_pairs))

"""Ring areas and ring-pair intersection areas in numpy: the fast path of ``maskiou.py``
(docs/ALGORITHM.md#matching §8.2).

Rings are polygons given by their vertices (closing edge implied), concatenated in one ``[V, 2]`` array with a
per-ring vertex count. All coordinates must be >= 0 (maskIoU clamps them to [0, 999]).

Trapezoid decomposition: an edge ``e`` spans ``[lo_e, hi_e]`` in x and bounds the trapezoid between itself and
``y = 0``, signed ``s_e = ±1`` by its x direction. For a closed ring,
``w(x, y) = Σ_e s_e [x in e, 0 <= y < y_e(x)]`` is its winding number (up to a global sign), so for two rings

    ∫∫ w_A w_B = Σ_{e in A} Σ_{f in B} s_e s_f ∫_{[lo_e, hi_e] ∩ [lo_f, hi_f]} min(y_e(x), y_f(x)) dx,

a closed form per edge pair. For SIMPLE rings ``w = ±1`` inside and 0 outside, so
``|∫∫ w_A w_B| = area(A ∩ B)``: the same value as a GEOS overlay up to float rounding, at a fraction of the
cost. A self-intersecting ring has winding numbers other than ±1 and maskIoU wants its even-odd repair: only
rings that :func:`star_simple` proves simple, or that GEOS calls valid, take this path.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Edges", "Rings", "pair_intersection_areas", "ring_areas", "ring_edges", "rings", "star_simple"]


class Rings(NamedTuple):
    """Rings as one vertex array: ring ``r`` is the next ``count[r]`` rows of ``xy`` (closing edge implied).

    Attributes:
        xy: ``[V, 2]`` vertices.
        count: ``[R]`` vertices per ring.
        ring_of: ``[V]`` ring of each vertex.
        nxt: ``[V]`` row of the next vertex along its ring (the last one wraps to the first).
    """

    xy: np.ndarray
    count: np.ndarray
    ring_of: np.ndarray
    nxt: np.ndarray


def rings(xy: np.ndarray, count: np.ndarray) -> Rings:
    """The :class:`Rings` of ``xy`` split by ``count``."""
    ends = np.cumsum(count)
    nxt = np.arange(1, len(xy) + 1)
    filled = count > 0
    nxt[ends[filled] - 1] = (ends - count)[filled]
    return Rings(xy, count, np.repeat(np.arange(len(count)), count), nxt)


def _cartesian(n_a: np.ndarray, n_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(group, i, j)`` flat over every group ``k`` and ``i < n_a[k]``, ``j < n_b[k]``, groups in order."""
    tot = n_a * n_b
    group = np.repeat(np.arange(len(tot)), tot)
    local = np.arange(int(tot.sum())) - np.repeat(np.cumsum(tot) - tot, tot)
    nb = n_b[group]
    return group, local // nb, local % nb


def star_simple(r: Rings) -> np.ndarray:
    """Per ring: True when its vertices go strictly around their mean exactly once, which makes it simple.

    Such a ring is star-shaped from the mean ``c``: edge ``i`` lies in the wedge between the rays through its
    two vertices, the wedges turn the same way, never overlap and close after one turn, so edges meet only at
    shared vertices and GEOS calls the polygon valid. Rings written in the canonical order of §2.4 (by angle
    around the vertex mean) almost always pass. The test is exact: it needs integral coordinates and uses
    ``n * v - Σ v`` (= ``n (v - c)``), whose cross products stay below 2**53 for coordinates up to 1e4 and
    fewer than 1000 vertices (other rings return False). False means "ask GEOS", not "invalid". Repeated
    consecutive vertices (common after clamping to the canvas) are ignored, as GEOS ignores them.
    """
    count, ring_of, nxt = r.count, r.ring_of, r.nxt
    n_rings = len(count)
    xy = r.xy
    dup = (xy == xy[nxt]).all(axis=1)
    if dup.any():
        # A vertex equal to the next adds a zero-length edge and GEOS ignores repeated points: the ring
        # without them decides (dropping every such vertex once leaves no two equal neighbours).
        keep = ~dup
        return star_simple(rings(xy[keep], np.bincount(ring_of[keep], minlength=n_rings)))
    ok = (count >= 3) & (count < 1000)
    if not (xy == np.round(xy)).all() or not (np.abs(xy) <= 1e4).all():  # NaN fails the first test
        exact = ((xy == np.round(xy)) & (np.abs(xy) <= 1e4)).all(1)
        ok &= np.bincount(ring_of, weights=~exact, minlength=n_rings) == 0
        xy = np.where(exact[:, None], xy, 0.0)
    if not ok.any():
        return ok
    n = count[ring_of].astype(np.float64)
    px = n * xy[:, 0] - np.bincount(ring_of, weights=xy[:, 0], minlength=n_rings)[ring_of]
    py = n * xy[:, 1] - np.bincount(ring_of, weights=xy[:, 1], minlength=n_rings)[ring_of]
    cross = px * py[nxt] - py * px[nxt]
    ccw = np.bincount(ring_of, weights=cross > 0, minlength=n_rings) == count
    cw = np.bincount(ring_of, weights=cross < 0, minlength=n_rings) == count
    ok &= ccw | cw
    # Every step turns by an angle in (0, pi) the same way, so the ring goes around c once iff exactly one
    # step crosses the ray from c along +x: counterclockwise from y < 0 to y >= 0, or clockwise the other way
    # (a vertex on the ray counts on arrival). Exact comparisons, no angles.
    below, below_next = py < 0, py[nxt] < 0
    crossing = np.where(ccw[ring_of], below & ~below_next, ~below & below_next)
    return ok & (np.bincount(ring_of, weights=crossing, minlength=n_rings) == 1)


class Edges(NamedTuple):
    """The non-vertical edges of a ring list; ring ``r`` owns rows ``off[r] : off[r] + num[r]``.

    Attributes:
        lo: left x of each edge.
        width: ``hi - lo`` (> 0) for the right x ``hi``.
        ylo: y at ``lo``.
        rise: y at ``hi`` minus ``ylo``.
        sign: +1 for an edge running towards +x, -1 otherwise.
        off: first row of each ring.
        num: edges of each ring.
    """

    lo: np.ndarray
    width: np.ndarray
    ylo: np.ndarray
    rise: np.ndarray
    sign: np.ndarray
    off: np.ndarray
    num: np.ndarray


def ring_edges(r: Rings) -> Edges:
    """Edge table of the rings; vertical edges add no area and are left out."""
    x0, y0 = r.xy[:, 0], r.xy[:, 1]
    x1, y1 = x0[r.nxt], y0[r.nxt]
    keep = np.flatnonzero(x0 != x1)
    x0, y0, x1, y1 = x0[keep], y0[keep], x1[keep], y1[keep]
    rightward = x0 < x1
    lo = np.minimum(x0, x1)
    ylo = np.where(rightward, y0, y1)
    num = np.bincount(r.ring_of[keep], minlength=len(r.count))
    return Edges(
        lo=lo,
        width=np.maximum(x0, x1) - lo,
        ylo=ylo,
        rise=np.where(rightward, y1, y0) - ylo,
        sign=np.where(rightward, 1.0, -1.0),
        off=np.cumsum(num) - num,
        num=num,
    )


def ring_areas(edges: Edges) -> np.ndarray:
    """Area of each SIMPLE ring (exact for integer coordinates: terms are multiples of 1/2 below 2**52)."""
    ring = np.repeat(np.arange(len(edges.num)), edges.num)
    signed = edges.sign * edges.width * (2.0 * edges.ylo + edges.rise) / 2.0
    return np.abs(np.bincount(ring, weights=signed, minlength=len(edges.num)))


def pair_intersection_areas(
    ea: Edges, ring_a: np.ndarray, eb: Edges, ring_b: np.ndarray, y_ref: np.ndarray
) -> np.ndarray:
    """``area(A_k ∩ B_k)`` for SIMPLE ring pairs ``A_k = ring_a[k]`` of ``ea``, ``B_k = ring_b[k]`` of ``eb``.

    Vectorized over all edge pairs of all ring pairs (see the module docstring). ``y_ref[k]`` is a height near
    the pair (e.g. the middle of its AABB overlap): the sum is invariant under a vertical shift (every
    vertical line crosses as many rightward as leftward edges), and measuring the trapezoids from there
    instead of from ``y = 0`` keeps the terms small, so their cancellation loses little precision.
    """
    n_pairs = len(ring_a)
    pair, i, j = _cartesian(ea.num[ring_a], eb.num[ring_b])
    ia = ea.off[ring_a][pair] + i
    ib = eb.off[ring_b][pair] + j
    a_lo, a_w, b_lo, b_w = ea.lo[ia], ea.width[ia], eb.lo[ib], eb.width[ib]
    xl = np.maximum(a_lo, b_lo)
    xr = np.minimum(a_lo + a_w, b_lo + b_w)
    live = np.flatnonzero(xr > xl)  # edge pairs whose x ranges overlap
    pair, ia, ib, xl, xr = pair[live], ia[live], ib[live], xl[live], xr[live]
    a_lo, a_w, b_lo, b_w = a_lo[live], a_w[live], b_lo[live], b_w[live]
    ref = y_ref[pair]
    a_y, a_rise, b_y, b_rise = ea.ylo[ia] - ref, ea.rise[ia], eb.ylo[ib] - ref, eb.rise[ib]
    # y at the ends of the shared x range; the fraction form is exact at an edge's own ends.
    ya_l = a_y + a_rise * ((xl - a_lo) / a_w)
    ya_r = a_y + a_rise * ((xr - a_lo) / a_w)
    yb_l = b_y + b_rise * ((xl - b_lo) / b_w)
    yb_r = b_y + b_rise * ((xr - b_lo) / b_w)
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

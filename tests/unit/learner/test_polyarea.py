"""Ring areas and ring-pair intersection areas in numpy (learner/stage2/matching/polyarea.py,
the maskIoU fast path)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import shapely

from learner.stage2.matching.polyarea import (
    pair_intersection_areas,
    ring_areas,
    ring_edges,
    rings,
    star_simple,
)


def _rings(*polys: list[tuple[float, float]]):
    xy = np.array([p for poly in polys for p in poly], dtype=float).reshape(-1, 2)
    return rings(xy, np.array([len(p) for p in polys]))


def _star(rng: random.Random, cx: int, cy: int) -> list[tuple[int, int]]:
    ang = sorted(rng.uniform(0, 2 * math.pi) for _ in range(rng.randint(3, 10)))
    return [
        (round(cx + rng.uniform(5, 150) * math.cos(a)), round(cy + rng.uniform(5, 150) * math.sin(a)))
        for a in ang
    ]


@pytest.mark.parametrize("seed", range(30))
def test_star_simple_implies_geos_valid_and_areas_are_exact(seed: int) -> None:
    rng = random.Random(seed)
    polys = []
    for _ in range(40):
        r = rng.random()
        if r < 0.5:
            polys.append(_star(rng, rng.randint(200, 800), rng.randint(200, 800)))
        elif r < 0.8:  # arbitrary order: often self-intersecting
            polys.append([(rng.randint(0, 300), rng.randint(0, 300)) for _ in range(rng.randint(3, 8))])
        else:  # near-degenerate: repeated points, collinear runs
            polys.append([(rng.randint(0, 3) * 10, rng.randint(0, 1) * 10) for _ in range(rng.randint(3, 6))])
    r = _rings(*polys)
    star = star_simple(r)
    areas = ring_areas(ring_edges(r))
    for poly, is_star, area in zip(polys, star, areas, strict=True):
        if is_star:
            shape = shapely.Polygon(poly)
            assert shape.is_valid, poly
            assert area == shape.area  # exact: integer coordinates
    assert star.any()


def test_star_simple_rejects_what_it_cannot_prove() -> None:
    square = [(0, 0), (10, 0), (10, 10), (0, 10)]
    bowtie = [(0, 0), (10, 10), (10, 0), (0, 10)]
    twice_around = [(10, 0), (0, 10), (-10, 0), (0, -10)] * 2
    repeated = [(0, 0), (0, 0), (0, 0)]
    halves = [(0.5, 0), (10, 0), (10, 10)]
    huge = [(0, 0), (2e4, 0), (2e4, 2e4)]
    nan = [(0, 0), (math.nan, 0), (10, 10)]
    got = star_simple(_rings(square, bowtie, twice_around, repeated, halves, huge, nan, [(0, 0), (1, 1)]))
    assert got.tolist() == [True, False, False, False, False, False, False, False]
    # Repeated neighbours (a closing copy of the first vertex included) are ignored, as GEOS ignores them.
    clamped = [(0, 0), (10, 0), (10, 0), (10, 10), (0, 10), (0, 0)]
    assert star_simple(_rings(clamped, square[:2] + square[1:3] + square[3:])).tolist() == [True, True]


@pytest.mark.parametrize("seed", range(30))
def test_pair_intersections_equal_geos(seed: int) -> None:
    rng = random.Random(seed)
    pairs = []
    for _ in range(25):
        a = _star(rng, rng.randint(200, 800), rng.randint(200, 800))
        kind = rng.random()
        if kind < 0.4:  # jittered copy: nearly coincident edges
            b = [(x + rng.randint(-3, 3), y + rng.randint(-3, 3)) for x, y in a]
        elif kind < 0.5:  # the same ring, shifted start
            k = rng.randrange(len(a))
            b = a[k:] + a[:k]
        elif kind < 0.7:  # a box, sharing coordinates with the ring
            xs, ys = [p[0] for p in a], [p[1] for p in a]
            x1, x2 = rng.choice(xs), rng.choice(xs)
            y1, y2 = min(ys), rng.choice(ys)
            b = [(x1, y1), (x2, y1), (x2, y2), (x1, y2)]
        else:  # anywhere: disjoint, nested or overlapping
            b = _star(rng, rng.randint(200, 800), rng.randint(200, 800))
        pairs.append((a, b))
    pairs = [(a, b) for a, b in pairs if shapely.Polygon(a).is_valid and shapely.Polygon(b).is_valid]
    r = _rings(*[p for ab in pairs for p in ab])
    edges = ring_edges(r)
    ring_a = np.arange(0, 2 * len(pairs), 2)
    y_ref = np.array([rng.uniform(0, 999) for _ in pairs])  # any height gives the same sum, up to rounding
    got = pair_intersection_areas(edges, ring_a, edges, ring_a + 1, y_ref)
    want = [shapely.intersection(shapely.Polygon(a), shapely.Polygon(b)).area for a, b in pairs]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-8)


def test_vertical_edges_are_dropped_and_rings_may_be_empty() -> None:
    r = _rings([(0, 0), (10, 0), (10, 10), (0, 10)], [], [(5, 5), (5, 5), (5, 5)])
    e = ring_edges(r)
    assert e.num.tolist() == [2, 0, 0] and e.off.tolist() == [0, 2, 2]
    assert ring_areas(e).tolist() == [100.0, 0.0, 0.0]

"""The crowded image task (`CROWDED_CONFIG`): determinism, crowding, and a GT that describes what is visible.

The GT is checked against an independent painter's rendering: every object's index painted in draw order
into one id map (later objects over earlier ones), so the pixels where index i survives are object i's
visible pixels; the GT box of a box-kind object must be their exact extent.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from learner.demo_data.images import (
    CROWDED_CONFIG,
    PixelObject,
    generate_images,
    object_mask,
    render_scene,
    sample_occluded_scene,
    visible_objects,
)


def _id_map(scene: list[PixelObject]) -> np.ndarray:
    ids = np.full((CROWDED_CONFIG.size, CROWDED_CONFIG.size), -1)
    for i, o in enumerate(scene):
        x1, y1, x2, y2 = o.box
        region = ids[y1 : y2 + 1, x1 : x2 + 1]
        region[object_mask(o, CROWDED_CONFIG)] = i
    return ids


def test_the_same_arguments_give_the_same_records_and_pixels() -> None:
    a = generate_images(6, 3, "train", CROWDED_CONFIG)
    b = generate_images(6, 3, "train", CROWDED_CONFIG)
    assert [r for r, _ in a] == [r for r, _ in b]
    assert all(x.tobytes() == y.tobytes() for (_, x), (_, y) in zip(a, b, strict=True))
    other = generate_images(6, 4, "train", CROWDED_CONFIG)
    assert [r["objects"] for r, _ in other] != [r["objects"] for r, _ in a]
    held_out = generate_images(6, 3, "eval", CROWDED_CONFIG)
    assert [r["objects"] for r, _ in held_out] != [r["objects"] for r, _ in a]


def test_scenes_are_crowded_with_same_category_neighbours_that_overlap() -> None:
    rng = random.Random(0)
    scenes = [sample_occluded_scene(rng, CROWDED_CONFIG) for _ in range(40)]
    counts = [len(s) for s in scenes]
    assert min(counts) >= CROWDED_CONFIG.min_objects and max(counts) <= CROWDED_CONFIG.max_objects
    assert np.mean(counts) >= 12
    overlapping_pairs = sum(
        min(a.box[2], b.box[2]) > max(a.box[0], b.box[0])
        and min(a.box[3], b.box[3]) > max(a.box[1], b.box[1])
        for s in scenes
        for k, a in enumerate(s)
        for b in s[k + 1 :]
        if a.desc == b.desc
    )
    assert overlapping_pairs >= 40  # about one overlapping same-category pair per scene at least


@pytest.mark.parametrize("seed", range(8))
def test_the_gt_is_what_is_visible(seed: int) -> None:
    rng = random.Random(seed)
    scene = sample_occluded_scene(rng, CROWDED_CONFIG)
    ids = _id_map(scene)
    gt = visible_objects(scene, CROWDED_CONFIG)
    image = np.asarray(render_scene(scene, random.Random(seed), CROWDED_CONFIG))
    for i, (drawn, truth) in enumerate(zip(scene, gt, strict=True)):
        ys, xs = np.nonzero(ids == i)
        drawn_pixels = int(object_mask(drawn, CROWDED_CONFIG).sum())
        assert len(xs) >= CROWDED_CONFIG.min_visible * drawn_pixels  # at least half of it is visible
        if drawn.ring:
            assert truth == drawn  # polygons are painted last and never overlap: whole, GT = the ring
            assert len(xs) == drawn_pixels
        else:
            assert truth.box == (xs.min(), ys.min(), xs.max(), ys.max())  # the visible extent, exactly
        rgb = np.array(CROWDED_CONFIG.categories[drawn.desc].rgb)
        colours = image[ys, xs]
        ok = np.all(colours == rgb, axis=1) | np.all(colours == rgb // 3, axis=1)  # fill or its outline
        assert ok.all()

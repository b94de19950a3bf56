"""Gallery: which samples are picked, and a PNG with both panels per sample."""

from __future__ import annotations

import pytest
from PIL import Image

from learner.predictions.gallery import pick_samples, write_gallery
from tests.unit.learner.evaluate.helpers import gt, png, pred, sample


def _pool(tmp_path, n):
    image = png(tmp_path / "img.png")
    out = []
    for i in range(n):  # sample i matches i of its 9 GT objects: F1 rises with i
        gts = [gt((10 * j, 10, 10 * j + 5, 20), pred_index=j if j < i else None) for j in range(9)]
        preds = [pred((10 * j, 10, 10 * j + 5, 20), gt=j, iou=1.0) for j in range(i)]
        out.append(sample(i, preds, gts, image=image))
    return out


def test_spread_picks_worst_median_and_best(tmp_path):
    picked = pick_samples(_pool(tmp_path, 9), 6, "spread")
    assert [(why, s.index) for why, s in picked] == [
        ("worst", 0),
        ("worst", 1),
        ("median", 3),
        ("median", 4),
        ("best", 8),
        ("best", 7),
    ]
    assert [s.index for _, s in pick_samples(_pool(tmp_path, 9), 2, "worst")] == [0, 1]
    assert [s.index for _, s in pick_samples(_pool(tmp_path, 9), 2, "best")] == [8, 7]
    assert [s.index for _, s in pick_samples(_pool(tmp_path, 9), 2, "first")] == [0, 1]
    assert len(pick_samples(_pool(tmp_path, 9), 20, "random")) == 9
    with pytest.raises(ValueError, match="spread"):
        pick_samples(_pool(tmp_path, 3), 2, "nope")  # type: ignore[arg-type]


def test_text_only_samples_are_never_picked():
    assert pick_samples([sample(0, [], [gt((1, 1, 5, 5))])], 6) == []


def test_write_gallery_draws_every_kind_of_object(tmp_path):
    image = png(tmp_path / "img.png", (200, 100))
    s = sample(
        0,
        [
            pred((100, 100, 400, 500), gt=0, iou=0.8),
            pred((120, 100, 420, 500), duplicate=True),
            pred((600, 600, 900, 900, 600, 900), geom="poly"),
        ],
        [gt((100, 120, 400, 520), pred_index=0), gt((700, 100, 900, 300))],
        image=image,
        size=(200, 100),
    )
    out = write_gallery([("worst", s)], tmp_path / "g" / "gallery.png", title="t")
    with Image.open(out) as im:
        assert im.size[0] > 300 and im.size[1] > 200

"""Tests of the synthetic demo detection set (learner/demo_data/scenes.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from learner.data.records import scene_user_text
from learner.demo_data.scenes import (
    CATEGORIES,
    DemoDataConfig,
    canonical_ring,
    describe_scene,
    generate_records,
    sample_scene,
    write_demo_dataset,
)

COORD = re.compile(r"^<\|coord_(\d{1,3})\|>$")


def _bins(values: list[str]) -> list[int]:
    out = []
    for v in values:
        m = COORD.match(v)
        assert m is not None, f"not a coord token string: {v!r}"
        out.append(int(m.group(1)))
    return out


def _anchor(obj: dict) -> tuple[int, int]:
    """§1.4 anchor, computed independently of the module: bbox (y1, x1), poly min (y, x) vertex."""
    if "bbox_2d" in obj:
        x1, y1, _, _ = _bins(obj["bbox_2d"])
        return y1, x1
    b = _bins(obj["poly"])
    return min((b[i + 1], b[i]) for i in range(0, len(b), 2))


def _signed_area(flat: list[int]) -> float:
    pts = list(zip(flat[0::2], flat[1::2], strict=True))
    return sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(pts, pts[1:] + pts[:1], strict=True)) / 2


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return generate_records(300, seed=0, split="train")


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    a = write_demo_dataset(tmp_path / "a", n_train=50, n_eval=20, seed=7)
    b = write_demo_dataset(tmp_path / "b", n_train=50, n_eval=20, seed=7)
    for pa, pb in zip(a, b, strict=True):
        assert pa.read_bytes() == pb.read_bytes()
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()


def test_write_is_idempotent(tmp_path: Path) -> None:
    train, held = write_demo_dataset(tmp_path, n_train=30, n_eval=10, seed=1)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (train, held)}
    assert write_demo_dataset(tmp_path, n_train=30, n_eval=10, seed=1) == (train, held)
    for p, (data, mtime) in before.items():
        assert p.read_bytes() == data
        assert p.stat().st_mtime_ns == mtime  # unchanged files are not rewritten


def test_rewrites_when_arguments_change(tmp_path: Path) -> None:
    train, _ = write_demo_dataset(tmp_path, n_train=30, n_eval=10, seed=1)
    first = train.read_text()
    write_demo_dataset(tmp_path, n_train=30, n_eval=10, seed=2)
    assert train.read_text() != first
    assert json.loads((tmp_path / "manifest.json").read_text())["seed"] == 2


def test_splits_and_seeds_differ(tmp_path: Path) -> None:
    train, held = write_demo_dataset(tmp_path, n_train=100, n_eval=100, seed=0)
    scenes_train = {json.loads(line)["metadata"]["scene"] for line in train.read_text().splitlines()}
    scenes_eval = {json.loads(line)["metadata"]["scene"] for line in held.read_text().splitlines()}
    # Independent streams: (almost) no eval scene appears in training;
    # 1-object scenes could collide by chance.
    assert len(scenes_train & scenes_eval) <= 2
    other = {r["metadata"]["scene"] for r in generate_records(100, seed=1, split="train")}
    assert len(scenes_train & other) <= 2


def test_record_shape(records: list[dict]) -> None:
    for r in records:
        assert r["images"] == []  # text-only demo: the scene replaces the image
        assert r["width"] == 1000 and r["height"] == 1000
        assert set(r["metadata"]) == {"id", "scene", "grid"}
        for o in r["objects"]:
            assert o["desc"].strip()
            assert ("bbox_2d" in o) != ("poly" in o)
            if "poly" in o:
                assert o["poly_points"] * 2 == len(o["poly"])


def test_category_object_count_and_polygon_coverage(records: list[dict]) -> None:
    descs = {o["desc"] for r in records for o in r["objects"]}
    assert len(descs) >= 5
    assert descs <= set(CATEGORIES)
    assert {len(r["objects"]) for r in records} == {1, 2, 3, 4, 5, 6}
    n_points = {o["poly_points"] for r in records for o in r["objects"] if "poly" in o}
    assert n_points == {3, 4}  # triangles and quadrilaterals
    assert any("bbox_2d" in o for r in records for o in r["objects"])


def test_objects_sorted_by_anchor(records: list[dict]) -> None:
    for r in records:
        anchors = [_anchor(o) for o in r["objects"]]
        assert anchors == sorted(anchors), r["metadata"]["id"]


def test_coordinates_are_valid_tokens_on_the_grid(records: list[dict]) -> None:
    grid = DemoDataConfig().grid
    for r in records:
        for o in r["objects"]:
            b = _bins(o.get("bbox_2d") or o["poly"])
            assert all(0 <= v <= 999 and v % grid == 0 for v in b)
            if "bbox_2d" in o:
                assert b[0] < b[2] and b[1] < b[3]


def test_polygons_are_canonical(records: list[dict]) -> None:
    for r in records:
        for o in r["objects"]:
            if "poly" not in o:
                continue
            b = _bins(o["poly"])
            ring = list(zip(b[0::2], b[1::2], strict=True))
            assert canonical_ring(ring) == ring
            assert ring[0] == min(ring, key=lambda p: (p[1], p[0]))  # top-most, then left-most first
            assert _signed_area(b) > 0  # clockwise on screen (y down), never degenerate


def test_scene_lists_every_object_in_answer_order(records: list[dict]) -> None:
    for r in records:
        scene = r["metadata"]["scene"]
        pos = 0
        for o in r["objects"]:
            chunk = o["desc"] + "".join(o.get("bbox_2d") or o["poly"])
            found = scene.find(chunk, pos)
            assert found >= 0, (chunk, scene)
            pos = found + len(chunk)


def test_distinct_values_and_descs_per_scene(records: list[dict]) -> None:
    for r in records:
        values = [v for o in r["objects"] for v in _bins(o.get("bbox_2d") or o["poly"])]
        assert len(values) == len(set(values))
        descs = [o["desc"] for o in r["objects"]]
        assert len(descs) == len(set(descs))


def test_scene_styles_and_user_text() -> None:
    import random

    objs = sample_scene(random.Random(3), DemoDataConfig(min_objects=2, max_objects=2))
    tight = describe_scene(objs, "tight")
    assert tight.startswith("Scene: ") and tight.endswith(".")
    assert " box " in describe_scene(objs, "verbose") or " polygon " in describe_scene(objs, "verbose")
    for style in ("tight", "compact", "verbose"):
        text = describe_scene(objs, style)
        for o in objs:
            assert o.desc in text
            assert all(f"<|coord_{v}|>" in text for v in o.coords)
    assert describe_scene([], "tight") == "Scene: nothing."
    assert scene_user_text("List objects.", tight) == "List objects.\n" + tight


@pytest.mark.parametrize(
    ("ring", "expected"),
    [
        # docs/ALGORITHM.md#coordinates §2.4 example: closing duplicate dropped, clockwise, top-left first.
        ([(10, 10), (10, 20), (20, 20), (20, 10), (10, 10)], [(10, 10), (20, 10), (20, 20), (10, 20)]),
        ([(30, 40), (20, 10), (10, 40)], [(20, 10), (30, 40), (10, 40)]),
    ],
    ids=["spec-2.4-square", "triangle"],
)
def test_canonical_ring(ring: list[tuple[int, int]], expected: list[tuple[int, int]]) -> None:
    assert canonical_ring(ring) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"grid": 0},
        {"min_objects": 0},
        {"min_objects": 4, "max_objects": 3},
        {"min_size": 10, "max_size": 5},
        {"max_objects": 9},  # distinct descs need at least as many categories as objects
        {"scene_style": "fancy"},
        {"categories": {"cat": "hexagon"}},
    ],
)
def test_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="DemoDataConfig"):
        DemoDataConfig(**kwargs)


def test_scene_words_are_single_tokens(tiny_tokenizer) -> None:
    """The copy task relies on one token per desc (in the answer and in the scene) and per coordinate."""
    for word in CATEGORIES:
        assert len(tiny_tokenizer.encode(word, add_special_tokens=False)) == 1, word
        assert tiny_tokenizer.encode(f' "{word}"', add_special_tokens=False)[1:-1] == tiny_tokenizer.encode(
            word, add_special_tokens=False
        )
    rec = generate_records(1, seed=0, split="eval", cfg=DemoDataConfig(min_objects=6))[0]
    ids = tiny_tokenizer.encode(rec["metadata"]["scene"], add_special_tokens=False)
    n_coords = sum(len(o.get("bbox_2d") or o["poly"]) for o in rec["objects"])
    coord_ids = set(tiny_tokenizer.convert_tokens_to_ids([f"<|coord_{k}|>" for k in range(1000)]))
    assert sum(i in coord_ids for i in ids) == n_coords

"""Tests of the synthetic image demo set (learner/demo_data/images.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from learner.config import load_run_config
from learner.data.records import load_records, validate_record
from learner.demo_data.images import (
    CATEGORIES,
    DEMO_SYSTEM_PROMPT,
    DEMO_USER_PROMPT,
    ImageDemoConfig,
    generate_images,
    write_image_dataset,
)
from learner.demo_data.scenes import canonical_ring
from learner.stage2.coords import bin_to_pixel
from tests.unit.learner.demo_data.test_scenes import _anchor, _bins

N = 60


@pytest.fixture(scope="module")
def train() -> list[tuple[dict, Image.Image]]:
    return generate_images(N, seed=0, split="train")


def test_same_arguments_give_the_same_records_and_pixels(train: list[tuple[dict, Image.Image]]) -> None:
    again = generate_images(N, seed=0, split="train")
    assert [r for r, _ in again] == [r for r, _ in train]
    assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(again, train, strict=True))


def test_splits_and_seeds_use_independent_streams(train: list[tuple[dict, Image.Image]]) -> None:
    def objects(pairs: list[tuple[dict, Image.Image]]) -> list[list[dict]]:
        return [r["objects"] for r, _ in pairs]

    held_out = generate_images(N, seed=0, split="eval")
    other_seed = generate_images(N, seed=1, split="train")
    assert objects(held_out) != objects(train)
    assert objects(other_seed) != objects(train)
    assert sum(a == b for a, b in zip(objects(held_out), objects(train), strict=True)) < N // 10
    assert held_out[0][0]["images"] == ["images/eval_00000.png"]


def test_records_validate_and_follow_the_spec_layout(train: list[tuple[dict, Image.Image]]) -> None:
    cfg = ImageDemoConfig()
    for i, (record, image) in enumerate(train):
        assert set(record) == {"images", "width", "height", "objects", "metadata"}
        assert "scene" not in record["metadata"]  # the learner would append it to the prompt
        assert record["images"] == [f"images/train_{i:05d}.png"]
        assert (record["width"], record["height"]) == image.size == (cfg.size, cfg.size)
        validate_record(record, path="/data/train.jsonl")
        assert cfg.min_objects <= len(record["objects"]) <= cfg.max_objects
        anchors = [_anchor(o) for o in record["objects"]]
        assert anchors == sorted(anchors)  # §1.4 sorted
        for obj in record["objects"]:
            geom = "poly" if obj["desc"] in ("tree", "rug") else "bbox_2d"
            assert CATEGORIES[obj["desc"]].geom == geom and geom in obj
            if geom == "poly":
                assert obj["poly_points"] == len(obj["poly"]) // 2 == (3 if obj["desc"] == "tree" else 4)


def test_geometry_lies_inside_the_image_and_rings_are_canonical(
    train: list[tuple[dict, Image.Image]],
) -> None:
    for record, _ in train:
        for obj in record["objects"]:
            if "bbox_2d" in obj:
                x1, y1, x2, y2 = _bins(obj["bbox_2d"])
                assert 0 <= x1 < x2 <= 999 and 0 <= y1 < y2 <= 999
            else:
                b = _bins(obj["poly"])
                ring = list(zip(b[0::2], b[1::2], strict=True))
                assert canonical_ring(ring) == ring
                assert all(0 <= v <= 999 for v in b)


def test_every_object_is_drawn_in_its_colour_at_its_place(train: list[tuple[dict, Image.Image]]) -> None:
    """The box centre (bbox) or the vertex mean (poly) holds the category colour, except for the hollow
    ``lamp`` frame, whose top-left corner does."""
    for record, image in train:
        size = record["width"]
        for obj in record["objects"]:
            b = _bins(obj.get("bbox_2d") or obj["poly"])
            xs = [bin_to_pixel(v, size) for v in b[0::2]]
            ys = [bin_to_pixel(v, size) for v in b[1::2]]
            if obj["desc"] == "lamp":
                point = (round(xs[0]) + 1, round(ys[0]) + 1)
            else:
                point = (round(sum(xs) / len(xs)), round(sum(ys) / len(ys)))
            assert image.getpixel(point) == CATEGORIES[obj["desc"]].rgb, (record["metadata"]["id"], obj)


def test_at_least_five_categories_and_both_geometry_kinds_occur(
    train: list[tuple[dict, Image.Image]],
) -> None:
    seen = {o["desc"] for r, _ in train for o in r["objects"]}
    kinds = {"poly" if "poly" in o else "bbox_2d" for r, _ in train for o in r["objects"]}
    assert len(CATEGORIES) >= 5 and seen == set(CATEGORIES)
    assert kinds == {"poly", "bbox_2d"}


def test_write_is_idempotent_and_loads_with_the_learner_reader(tmp_path: Path) -> None:
    train_path, eval_path = write_image_dataset(tmp_path, n_train=6, n_eval=3, seed=0)
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    write_image_dataset(tmp_path, n_train=6, n_eval=3, seed=0)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == stamps
    records = load_records(train_path)
    assert len(records) == 6 and len(load_records(eval_path)) == 3
    first = json.loads(train_path.read_text().splitlines()[0])
    assert records[0]["images"] == [str(tmp_path / first["images"][0])]
    with Image.open(records[0]["images"][0]) as img:
        assert img.size == (first["width"], first["height"])
    assert json.loads((tmp_path / "manifest.json").read_text())["n_train"] == 6


def test_a_written_set_is_reused_and_an_incomplete_or_different_one_is_drawn_again(tmp_path: Path) -> None:
    import learner.demo_data.images as images

    write_image_dataset(tmp_path, n_train=4, n_eval=2, seed=0)
    drawn = []
    real = images.generate_images
    images.generate_images = lambda *a, **k: drawn.append(a) or real(*a, **k)
    try:
        write_image_dataset(tmp_path, n_train=4, n_eval=2, seed=0)
        assert drawn == []  # complete and equal: returned without drawing
        first_image = (
            tmp_path / json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])["images"][0]
        )
        first_image.unlink()
        write_image_dataset(tmp_path, n_train=4, n_eval=2, seed=0)
        assert len(drawn) == 2 and first_image.exists()  # a missing image: drawn again
        drawn.clear()
        write_image_dataset(tmp_path, n_train=5, n_eval=2, seed=0)
        assert len(drawn) == 2  # another set: drawn
    finally:
        images.generate_images = real
    assert json.loads((tmp_path / "manifest.json").read_text())["n_train"] == 5


def test_config_rejects_boxes_larger_than_the_image() -> None:
    with pytest.raises(ValueError, match="max_side"):
        ImageDemoConfig(size=64, min_side=40, max_side=64)


def test_demo_config_prompts_are_the_ones_the_stage1_asset_was_trained_on() -> None:
    """configs/demo_vlm_cpu.yaml rolls out with the prompts of scripts/vlm_pretrain.py (the shipped
    asset's)."""
    repo = Path(__file__).resolve().parents[4]
    cfg = load_run_config(repo / "configs" / "demo_vlm_cpu.yaml")
    assert cfg.prompts.system == DEMO_SYSTEM_PROMPT
    assert cfg.prompts.user == DEMO_USER_PROMPT
    info = json.loads((repo / "assets" / "tiny-qwen3-vl-demo-stage1" / "pretrain_info.json").read_text())
    assert info["config"]["system_prompt"] == DEMO_SYSTEM_PROMPT
    assert info["config"]["user_prompt"] == DEMO_USER_PROMPT

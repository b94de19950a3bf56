"""Pixel annotations → training records (learner/data/convert.py), on real image files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from learner.data.convert import ConvertError, convert_coco, convert_pixels, main
from learner.data.records import load_records
from learner.stage2.coords import bbox_to_bins
from learner.stage2.gt import parse_gt_object


def _image(path: Path, size: tuple[int, int], mode: str = "RGB", orientation: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new(mode, size, 128 if mode in ("L", "P") else (10, 200, 30, 255)[: len(mode)])
    if orientation is None:
        image.save(path)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation  # EXIF Orientation
        image.save(path, exif=exif)
    return path


def _coco(tmp_path: Path) -> dict:
    _image(tmp_path / "imgs" / "a.jpg", (640, 480))
    _image(tmp_path / "imgs" / "sub" / "b.png", (97, 211), "RGBA")
    _image(tmp_path / "imgs" / "c.png", (50, 40), "L")
    return {
        "images": [
            {"id": 1, "file_name": "a.jpg", "width": 640, "height": 480},
            {"id": 2, "file_name": "sub/b.png", "width": 97, "height": 211},
            {"id": 3, "file_name": "c.png", "width": 50, "height": 40},
        ],
        "categories": [{"id": 7, "name": "traffic light"}, {"id": 9, "name": "café"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 7, "bbox": [320, 240, 100, 50],
             "segmentation": [[320, 240, 420, 240, 420, 290], [0, 0, 1, 0, 1, 1]]},
            {"id": 2, "image_id": 1, "category_id": 9, "bbox": [0, 0, 639, 479],
             "segmentation": {"counts": "rle"}},
            {"id": 3, "image_id": 2, "category_id": 9, "bbox": [10, 10, 0, 5]},
            {"id": 4, "image_id": 2, "category_id": 7, "bbox": [90, 200, 20, 20]},
        ],
    }  # fmt: skip


@pytest.mark.parametrize("geometry", ["bbox", "poly"])
def test_coco_records_load_and_every_object_parses(tmp_path: Path, geometry: str) -> None:
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps(_coco(tmp_path)))
    out = tmp_path / "data" / "train.jsonl"
    assert main(["coco", "--annotations", str(ann), "--images", str(tmp_path / "imgs"), "--out", str(out),
                 "--geometry", geometry]) == 0  # fmt: skip
    records = load_records(out)  # relative paths resolve from the output's folder, and the files exist
    assert [Path(r["images"][0]).name for r in records] == ["a.jpg", "b.png", "c.png"]
    assert json.loads(out.read_text().splitlines()[1])["images"] == ["../imgs/sub/b.png"]
    first, second, third = records
    assert [o["desc"] for o in first["objects"]] == ["traffic light", "café"]
    if geometry == "bbox":
        assert first["objects"][0]["bbox_2d"] == bbox_to_bins([320, 240, 420, 290], 640, 480)
    else:  # the larger polygon part; the crowd RLE falls back to its box
        assert first["objects"][0]["poly"] == [500, 501, 657, 501, 657, 605]
        assert "bbox_2d" in first["objects"][1]
    assert first["objects"][1]["bbox_2d"] == [0, 0, 999, 999]
    assert len(second["objects"]) == 1  # the zero-width box is dropped
    assert second["objects"][0]["bbox_2d"][2] == 999  # clamped at the border
    assert third["objects"] == []  # an image without annotations is a negative example
    for record in records:
        for obj in record["objects"]:
            parse_gt_object(obj)


def test_sizes_that_differ_from_the_pixels_are_refused_naming_exif(tmp_path: Path) -> None:
    coco = _coco(tmp_path)
    _image(tmp_path / "imgs" / "rot.jpg", (640, 480), orientation=6)  # displays as 480x640
    coco["images"].append({"id": 4, "file_name": "rot.jpg", "width": 640, "height": 480})
    coco["images"].append({"id": 5, "file_name": "missing.jpg", "width": 10, "height": 10})
    coco["images"][0]["width"] = 600
    with pytest.raises(ConvertError) as caught:
        convert_coco_json(tmp_path, coco)
    text = str(caught.value)
    assert "3 problem(s)" in text
    assert "image id 4" in text and "EXIF" in text and "480x640" in text
    assert "image id 1" in text and "annotated 600x480 but the image decodes to 640x480" in text
    assert "image id 5" in text and "does not exist" in text


def convert_coco_json(tmp_path: Path, coco: dict) -> None:
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps(coco))
    convert_coco(ann, tmp_path / "imgs", tmp_path / "out.jsonl")


def test_pixel_jsonl_reads_sizes_from_the_images_and_names_bad_objects(tmp_path: Path, capsys) -> None:
    _image(tmp_path / "in" / "p.png", (200, 100), "P")
    good = {"images": ["p.png"], "objects": [
        {"desc": "dog", "bbox_2d": [0, 0, 199, 99]},
        {"desc": "cat", "poly": [[10, 10], [150, 10], [150, 90]]},
    ], "summary": "kept"}  # fmt: skip
    source = tmp_path / "in" / "px.jsonl"
    source.write_text(json.dumps(good) + "\n")
    records, counts = convert_pixels(source, tmp_path / "out" / "train.jsonl")
    (record,) = records
    assert (record["width"], record["height"], record["summary"]) == (200, 100, "kept")
    assert record["objects"][0]["bbox_2d"] == [0, 0, 999, 999]
    assert record["objects"][1]["poly"] == [50, 101, 753, 101, 753, 908]
    assert counts["objects"] == 2
    bad = {
        "images": ["p.png"],
        "objects": [{"desc": "x", "poly": [1, 1, 1, 1, 1, 1]}, {"desc": "", "bbox_2d": [1, 2, 3, 4]}],
    }
    source.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n" + "{not json\n")
    out = tmp_path / "out" / "bad.jsonl"
    assert main(["pixels", "--input", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nothing written" in err and not out.exists()
    assert "px.jsonl:2 object 0: poly has fewer than 3 distinct vertices" in err
    assert "px.jsonl:2 object 1: desc ''" in err and "px.jsonl:3: needs JSON" in err

"""JSONL records and the sample dict (docs/ALGORITHM.md#records §1.1, §1.5; required tests §20.1)."""

from __future__ import annotations

import json
import os

import pytest

from learner.data.messages import DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_PROMPT
from learner.data.records import (
    DataRecordError,
    build_sample,
    load_records,
    make_sample_id,
    resolve_image,
    validate_record,
)

REC = {
    "images": ["img/000123.jpg"],
    "width": 640,
    "height": 480,
    "objects": [
        {"desc": "sofa", "poly": [40, 500, 900, 520, 880, 990, 30, 980], "poly_points": 4},
        {"desc": "cat", "bbox_2d": ["<|coord_156|>", "<|coord_415|>", "<|coord_467|>", "<|coord_832|>"]},
    ],
    "summary": "a cat on a sofa",
    "metadata": {"source": "unit"},
}


def _write(tmp_path, lines, *, touch_images: bool = True) -> str:
    """The JSONL under `tmp_path/data`; with `touch_images`, the records' relative image files exist beside it
    and under `tmp_path/root` (load_records checks that local image files exist)."""
    p = tmp_path / "data" / "train.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    if touch_images:
        for line in lines:
            for ref in line.get("images", []) if isinstance(line, dict) else []:
                if isinstance(ref, str) and ref and not os.path.isabs(ref):
                    for base in (p.parent, tmp_path / "root"):
                        (base / ref).parent.mkdir(parents=True, exist_ok=True)
                        (base / ref).touch()
    return str(p)


def test_missing_image_files_fail_at_load_listing_lines_and_count(tmp_path):
    records = [{**REC, "images": [f"img/{i}.jpg"]} for i in range(8)]
    path = _write(tmp_path, records)
    for i in (1, 2, 3, 4, 5, 6, 7):
        (tmp_path / "data" / "img" / f"{i}.jpg").unlink()
    with pytest.raises(DataRecordError) as err:
        load_records(path)
    assert err.value.line_no == 2 and "7 image file(s) do not exist" in err.value.reason
    assert (
        "line 2:" in err.value.reason
        and "img/1.jpg" in err.value.reason
        and "(and 2 more)" in err.value.reason
    )
    assert "data.image_root" in err.value.reason
    (tmp_path / "root" / "img" / "0.jpg").unlink()
    with pytest.raises(
        DataRecordError, match=r"train.jsonl:1: 1 image file.*root/img/0.jpg.*data.image_root"
    ):
        load_records(path, image_root=tmp_path / "root")
    urls = [{**REC, "images": ["https://h/x.jpg"]}, {**REC, "images": ["data:image/png;base64,AAAA"]}]
    assert len(load_records(_write(tmp_path, urls))) == 2  # never fetched at load
    with pytest.raises(DataRecordError, match="/no/such.jpg"):  # a file:// URL is a local file
        load_records(_write(tmp_path, [{**REC, "images": ["file:///no/such.jpg"]}]))


def test_missing_images_raises_with_line_number(tmp_path):
    bad = {k: v for k, v in REC.items() if k != "images"}
    path = _write(tmp_path, [REC, "", bad])
    with pytest.raises(DataRecordError) as err:
        load_records(path)
    assert err.value.line_no == 3 and err.value.path == path and "images" in err.value.reason
    assert f"{path}:3" in str(err.value)


@pytest.mark.parametrize(
    ("patch", "word"),
    [
        ({"width": 0}, "width"),
        ({"height": -3}, "height"),
        ({"width": True}, "width"),
        ({"width": 64.0}, "width"),
        ({"images": []}, "images"),
        ({"images": ["a.jpg", "b.jpg"]}, "images"),
        ({"images": [{"path": "a.jpg"}]}, "images"),
        ({"objects": {}}, "objects"),
    ],
)
def test_record_level_violations_raise(tmp_path, patch, word):
    path = _write(tmp_path, [{**REC, **patch}])
    with pytest.raises(DataRecordError) as err:
        load_records(path)
    assert err.value.line_no == 1 and word in err.value.reason


def test_invalid_json_and_non_object_lines(tmp_path):
    with pytest.raises(DataRecordError, match=":2: invalid JSON"):
        load_records(_write(tmp_path, [REC, "{not json"]))
    with pytest.raises(DataRecordError, match="expected an object"):
        load_records(_write(tmp_path, ["[1, 2]"]))


def test_object_level_problems_do_not_raise_at_load(tmp_path):
    rec = {**REC, "objects": [{"desc": "", "bbox_2d": [1, 2, 3]}]}
    (r,) = load_records(_write(tmp_path, [rec]))
    assert r["objects"] == rec["objects"]


def test_image_path_resolution(tmp_path):
    path = _write(tmp_path, [REC])
    (r,) = load_records(path)
    assert r["images"] == [os.path.join(os.path.abspath(os.path.dirname(path)), "img/000123.jpg")]
    (r,) = load_records(path, image_root=tmp_path / "root")
    assert r["images"] == [os.path.join(str(tmp_path / "root"), "img/000123.jpg")]
    for kept in (
        "/abs/x.jpg",
        "http://h/x.jpg",
        "https://h/x.png",
        "file:///x.jpg",
        "data:image/png;base64,AAAA",
    ):
        assert resolve_image(kept, "/somewhere", "/root") == kept


def test_max_images_per_sample(tmp_path):
    rec = {**REC, "images": ["a.jpg", "b.jpg"]}
    (r,) = load_records(_write(tmp_path, [rec]), max_images_per_sample=2)
    assert len(r["images"]) == 2


def test_sample_id():
    assert make_sample_id(0, 5) == 5
    assert make_sample_id(3, 7) == (3 << 32) | 7 == 12884901895
    with pytest.raises(ValueError):
        make_sample_id(0, 1 << 32)


def test_build_sample(tmp_path):
    rec = validate_record(REC, path=str(tmp_path / "d.jsonl"), line_no=1)
    s = build_sample(rec, base_idx=9, dataset="toy", dataset_namespace=2)
    assert set(s) == {
        "messages",
        "gt_objects",
        "images",
        "width",
        "height",
        "base_idx",
        "dataset",
        "sample_id",
        "summary",
        "metadata",
    }
    assert s["sample_id"] == (2 << 32) | 9 and s["base_idx"] == 9 and s["dataset"] == "toy"
    assert [o["desc"] for o in s["gt_objects"]] == ["cat", "sofa"]  # sorted by (y, x) anchor: 415 < 500
    assert s["messages"] == [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": s["images"][0]},
                {"type": "text", "text": DEFAULT_USER_PROMPT},
            ],
        },
    ]
    assert (s["width"], s["height"], s["summary"], s["metadata"]) == (
        640,
        480,
        "a cat on a sofa",
        {"source": "unit"},
    )


def test_build_sample_with_assistant_and_custom_prompts():
    rec = validate_record({**REC, "objects": [*REC["objects"], {"desc": "", "bbox_2d": [1, 2, 3, 4]}]})
    s = build_sample(
        rec,
        base_idx=0,
        dataset="t",
        dataset_namespace=0,
        system_prompt=None,
        user_prompt="go",
        include_assistant=True,
    )
    assert [m["role"] for m in s["messages"]] == ["user", "assistant"]
    assert s["messages"][0]["content"][-1] == {"type": "text", "text": "go"}
    assert s["messages"][1]["content"].startswith('{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_156|>"')
    assert (
        '"object_2": {"desc": "sofa", "poly": [["<|coord_40|>", "<|coord_500|>"]'
        in s["messages"][1]["content"]
    )
    assert len(s["gt_objects"]) == 3  # the malformed object stays for GT extraction to count

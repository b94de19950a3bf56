"""Assistant output format (docs/ALGORITHM.md#output-format; required test §20.3)."""

from __future__ import annotations

import json

import pytest

from learner.stage2.format import geometry_value, serialize_entry, serialize_objects
from learner.stage2.gt import GTObject


def test_20_3_single_bbox_object():
    obj = GTObject(1, "cat", "bbox_2d", (156, 415, 467, 832))
    assert serialize_objects([obj]) == (
        '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_156|>", "<|coord_415|>", "<|coord_467|>", '
        '"<|coord_832|>"]}}'
    )


def test_section_4_example_with_poly():
    objs = [
        GTObject(1, "cat", "bbox_2d", (156, 415, 467, 832)),
        GTObject(2, "sofa", "poly", (40, 500, 900, 520, 880, 990, 30, 980)),
    ]
    assert serialize_objects(objs) == (
        '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_156|>", "<|coord_415|>", "<|coord_467|>", '
        '"<|coord_832|>"]}, "object_2": {"desc": "sofa", "poly": [["<|coord_40|>", "<|coord_500|>"], '
        '["<|coord_900|>", "<|coord_520|>"], ["<|coord_880|>", "<|coord_990|>"], ["<|coord_30|>", '
        '"<|coord_980|>"]]}}'
    )


def test_empty_answer():
    assert serialize_objects([]) == "{}"


def test_entry_numbering_and_escaping():
    e = serialize_entry(4, 'chat "noir" 猫', "bbox_2d", [1, 2, 3, 4])
    assert e.startswith('"object_4": {"desc": "chat \\"noir\\" 猫", "bbox_2d": [')
    assert json.loads("{" + e + "}")["object_4"]["desc"] == 'chat "noir" 猫'
    assert serialize_objects([GTObject(1, "a", "bbox_2d", (1, 2, 3, 4))], start=7).startswith('{"object_7"')


@pytest.mark.parametrize(
    ("geom", "bins"),
    [("bbox_2d", [1, 2, 3]), ("poly", [1, 2, 3, 4]), ("poly", [1, 2, 3, 4, 5, 6, 7]), ("box", [1] * 4)],
)
def test_bad_geometry_raises(geom, bins):
    with pytest.raises(ValueError):
        geometry_value(geom, bins)


def test_bad_object_number_raises():
    with pytest.raises(ValueError):
        serialize_entry(0, "a", "bbox_2d", [1, 2, 3, 4])


def test_entry_text_is_json_dumps_of_the_object():
    import random

    rng = random.Random(0)
    descs = ["cat", 'say "hi"', "back\\slash", "tab\there", "猫", "é\u0301", "\u2028", "", " "]
    for n in range(1, 300):
        geom = rng.choice(["bbox_2d", "poly"])
        bins = tuple(rng.randint(0, 999) for _ in range(4 if geom == "bbox_2d" else 2 * rng.randint(3, 7)))
        desc = rng.choice(descs)
        want = f'"object_{n}": ' + json.dumps(
            {"desc": desc, geom: geometry_value(geom, bins)}, ensure_ascii=False, separators=(", ", ": ")
        )
        assert serialize_entry(n, desc, geom, bins) == want


def test_bad_bins_still_raise_from_the_table_path():
    from learner.stage2.coords import CoordValueError

    for bins in [(1, 2, 3, 1000), (1, 2, 3, -1), (1, 2, 3, True), (1, 2, 3, 4.0)]:
        with pytest.raises(CoordValueError):
            serialize_entry(1, "x", "bbox_2d", bins)

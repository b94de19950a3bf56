"""Coordinate codec (docs/ALGORITHM.md#coordinates, §1.3; required tests §20.1)."""

from __future__ import annotations

import math

import pytest

from learner.stage2.coords import (
    COORD_BINS,
    CoordValueError,
    CoordVocab,
    CoordVocabError,
    anti_collapse,
    bbox_to_bins,
    bin_to_pixel,
    canonicalize_poly,
    coord_token,
    parse_coord_string,
    parse_coord_values,
    pixel_to_bin,
)
from tests.unit.learner.toy_tokenizer import ToyTokenizer


@pytest.mark.parametrize(
    ("v", "size", "k"),
    [(320, 640, 500), (240, 480, 501), (0, 640, 0), (639, 640, 999), (-5, 640, 0), (700, 640, 999)],
    ids=["§2.2-x320", "§2.2-y240", "§2.2-zero", "§2.2-max", "clamp-low", "clamp-high"],
)
def test_pixel_to_bin(v, size, k):
    assert pixel_to_bin(v, size) == k


def test_pixel_to_bin_rounds_half_to_even():
    # size 1999: v / 1998 * 999 = v / 2, so odd v lands exactly on .5
    assert pixel_to_bin(1, 1999) == 0 and pixel_to_bin(3, 1999) == 2 and pixel_to_bin(5, 1999) == 2


def test_bin_to_pixel_inverse():
    assert bin_to_pixel(500, 640) == pytest.approx(319.82, abs=0.005)
    assert bin_to_pixel(0, 640) == 0 and bin_to_pixel(999, 640) == 639


def test_bad_sizes_and_values_raise():
    with pytest.raises(CoordValueError):
        pixel_to_bin(3, 1)
    with pytest.raises(CoordValueError):
        pixel_to_bin(math.nan, 640)
    with pytest.raises(CoordValueError):
        bbox_to_bins([1, 2, 3], 640, 480)


@pytest.mark.parametrize(
    ("box", "bins"),
    [
        ([5, 5, 5, 5], [5, 5, 6, 6]),
        ([999, 999, 999, 999], [998, 998, 999, 999]),
        ([5.2, 7.9, 10.1, 7.9], [5, 7, 11, 8]),
    ],
    ids=["§2.3-collapsed", "§2.3-corner", "floor-ceil"],
)
def test_bbox_anti_collapse_identity_scale(box, bins):
    assert bbox_to_bins(box, 1000, 1000) == bins


def test_bbox_to_bins_scales_and_keeps_order():
    b = bbox_to_bins([10, 20, 630, 470], 640, 480)
    assert b == [
        math.floor(10 * 999 / 639),
        math.floor(20 * 999 / 479),
        math.ceil(630 * 999 / 639),
        math.ceil(470 * 999 / 479),
    ]
    assert b[0] < b[2] and b[1] < b[3]


def test_anti_collapse():
    assert anti_collapse(3, 9) == (3, 9)
    assert anti_collapse(9, 3) == (9, 10)
    assert anti_collapse(999, 999) == (998, 999)


@pytest.mark.parametrize(
    ("pts", "out"),
    [
        ([(10, 10), (10, 20), (20, 20), (20, 10), (10, 10)], ("poly", [10, 10, 20, 10, 20, 20, 10, 20])),
        ([(10, 10), (20, 10), (30, 10)], ("bbox_2d", [10, 10, 30, 11])),
        ([20, 20, 10, 20, 10, 10, 20, 10], ("poly", [10, 10, 20, 10, 20, 20, 10, 20])),
        ([(50, 90), (10, 10), (90, 40)], ("poly", [10, 10, 90, 40, 50, 90])),
        ([(5, 5), (5, 5), (5, 5)], ("bbox_2d", [5, 5, 6, 6])),
    ],
    ids=["§2.4-square", "§2.4-collinear", "flat-input", "triangle-clockwise", "point"],
)
def test_canonicalize_poly(pts, out):
    assert canonicalize_poly(pts) == out


def test_canonical_poly_is_clockwise_on_screen():
    geom, bins = canonicalize_poly([(0, 0), (0, 100), (100, 100), (100, 0)])
    pts = list(zip(bins[::2], bins[1::2], strict=True))
    area2 = sum(pts[j][0] * pts[(j + 1) % 4][1] - pts[(j + 1) % 4][0] * pts[j][1] for j in range(4))
    assert (
        geom == "poly" and pts[0] == (0, 0) and area2 > 0
    )  # y down: positive shoelace = clockwise on screen


def test_coord_token_and_string_parse():
    assert coord_token(0) == "<|coord_0|>" and coord_token(999) == "<|coord_999|>"
    assert parse_coord_string("<|coord_42|>") == 42
    for bad in (-1, 1000, True, 3.0):
        with pytest.raises(CoordValueError):
            coord_token(bad)
    for bad in ("<|coord_1000|>", "<|coord_x|>", "42", "<|coord_42|> "):
        with pytest.raises(CoordValueError):
            parse_coord_string(bad)


def test_parse_coord_values_rules_of_1_3():
    assert parse_coord_values(["<|coord_3|>", "<|coord_7|>"]) == [3, 7]
    assert parse_coord_values([3, 7.5, 8.5, 999.4]) == [3, 8, 8, 999]  # half-to-even
    for bad in (["<|coord_3|>", 7], [True, 1], [1, math.inf], [1000], [-0.6], [None], ["7"]):
        with pytest.raises(CoordValueError):
            parse_coord_values(bad)


def test_coord_vocab_from_toy_tokenizer():
    tok = ToyTokenizer()
    cv = CoordVocab.from_tokenizer(tok)
    assert len(cv.ids) == COORD_BINS and len(set(cv.ids)) == COORD_BINS
    assert all(cv.id_to_bin[t] == k for k, t in enumerate(cv.ids))
    assert cv.is_coord(cv.ids[500]) and not cv.is_coord(tok.id_of("{"))


def test_coord_vocab_missing_token_raises():
    with pytest.raises(CoordVocabError, match=r"<\|coord_500\|>"):
        CoordVocab.from_tokenizer(ToyTokenizer(missing_coords=[500]))


def test_coord_vocab_shared_id_raises():
    tok = ToyTokenizer(missing_coords=[7])
    tok._added["<|coord_7|>"] = tok._added["<|coord_8|>"]  # two strings, one id
    with pytest.raises(CoordVocabError, match="share id"):
        CoordVocab.from_tokenizer(tok)


def test_coord_vocab_not_single_id_raises():
    class Splitting(ToyTokenizer):
        def encode(self, text, add_special_tokens=False):
            return [t for tid in super().encode(text) for t in (tid, tid)]

    with pytest.raises(CoordVocabError, match="single id"):
        CoordVocab.from_tokenizer(Splitting())


def test_coord_vocab_real_tokenizer(tiny_tokenizer):
    cv = CoordVocab.from_tokenizer(tiny_tokenizer)
    assert tiny_tokenizer.convert_ids_to_tokens(cv.ids[123]) == "<|coord_123|>"


def test_parse_coord_values_reads_iterators_once_and_keeps_the_loop_rules():
    from learner.stage2.coords import CoordValueError, parse_coord_values

    strings = ["<|coord_0|>", "<|coord_999|>", "<|coord_5|>"]
    assert parse_coord_values(iter(strings)) == parse_coord_values(strings) == [0, 999, 5]
    assert parse_coord_values(s for s in strings) == [0, 999, 5]
    assert parse_coord_values([3, 4.5, 5]) == [3, 4, 5]
    for bad in (["<|coord_1|>", 2], ["<|coord_1000|>"], [True], ["<|coord_1|>", None], [["<|coord_1|>"]]):
        with pytest.raises(CoordValueError):
            parse_coord_values(bad)

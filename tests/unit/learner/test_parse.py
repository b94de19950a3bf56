"""Strict token-aligned parser (docs/ALGORITHM.md#parsing, required tests §20.6, worked example
§21.1–21.2)."""

from __future__ import annotations

import pytest

from learner.stage2.coords import CoordVocab
from learner.stage2.parse import parser as parse_mod
from learner.stage2.parse.detok import decode_text, token_pieces
from learner.stage2.parse.parser import CutRoundTripError, parse_rollout, token_cut
from tests.unit.learner.parse_checks import assert_parse_invariants
from tests.unit.learner.toy_tokenizer import PrefixDecodingToyTokenizer, ToyTokenizer

PIECES = [
    '{"',
    "object",
    '":',
    ' {"',
    "desc",
    ' "',
    '",',
    ' ["',
    ' [["',
    '"],',
    '"]',
    '"]]',
    "},",
    "}}",
    "bbox",
    "poly",
]
PIECES += ["person", "dog", "cat", "rug", "garbage"]
CAT = "猫".encode()  # e7 8c ab


@pytest.fixture(scope="module", params=["bytes", "prefix-decoding"])
def tok(request) -> ToyTokenizer:
    """The toy with its byte table, and the same toy forcing the detokenizer's prefix-decoding fallback."""
    cls = ToyTokenizer if request.param == "bytes" else PrefixDecodingToyTokenizer
    return cls(PIECES + [CAT[:2], CAT[2:], b'"]}\xe7', CAT[1:]])


@pytest.fixture(scope="module")
def cv(tok) -> CoordVocab:
    return CoordVocab.from_tokenizer(tok)


def head(n: int, desc: str, geom: str = "bbox", first: bool = False) -> list:
    """Tokens of ``"object_n": {"desc": "<desc>", "<geom>_2d"|"poly": ``, §21.1 style."""
    key = ['{"' if first else ' "', "object", "_", str(n), '":', ' {"', "desc", '":', ' "', desc, '",', ' "']
    return key + (["bbox", "_", "2", "d", '":'] if geom == "bbox" else ["poly", '":'])


def coords(bins: list) -> list:
    """Tokens of a coordinate list up to its last value, `[' ["', b0, '",', ' "', b1, ...]`; an entry that is
    a list stands for the pieces of one value."""
    out = [' ["']
    for j, b in enumerate(bins):
        out += ([] if j == 0 else ['",', ' "']) + (b if isinstance(b, list) else [b])
    return out


def bbox(n: int, desc: str, bins: list, first: bool = False, close: str = "},") -> list:
    return head(n, desc, first=first) + coords(bins) + ['"]', close]


def parse(tok, cv, pieces):
    r = parse_rollout(tok.ids_of(pieces), tok, cv)
    assert_parse_invariants(r, tok, cv)
    return r


def parse_text(tok, cv, text: str):
    r = parse_rollout(tok.encode(text), tok, cv)
    assert_parse_invariants(r, tok, cv)
    return r


# ------------------------------------------------------------------------------------------------------------
# §21 worked example


def worked_example_pieces() -> list:
    toks = bbox(1, "person", [104, 84, 296, 610], first=True)
    toks += bbox(2, "dog", [880, 60, 990, 180])
    toks += bbox(3, "cat", [20, 20, 60])
    toks += head(4, "rug")[:10]
    return toks


def test_worked_example_21_1_token_layout(tok):
    toks = worked_example_pieces()
    assert len(toks) == 97
    assert toks[18] == 104 and toks[29] == "}," and toks[57] == 180 and toks[86] == "}," and toks[96] == "rug"
    assert toks[92] == ' {"'


def test_worked_example_21_2_parse(tok, cv):
    ids = tok.ids_of(worked_example_pieces())
    r = parse(tok, cv, worked_example_pieces())
    assert [(o.key, o.valid) for o in r.all_objects] == [
        ("object_1", True),
        ("object_2", True),
        ("object_3", False),
        ("object_4", False),
    ]
    o1, o2 = r.valid_objects
    assert (o1.index, o1.desc, o1.geom_type, o1.bins, o1.coord_token_indices) == (
        1,
        "person",
        "bbox_2d",
        (104, 84, 296, 610),
        (18, 21, 24, 27),
    )
    assert (o2.index, o2.desc, o2.bins, o2.coord_token_indices) == (
        2,
        "dog",
        (880, 60, 990, 180),
        (48, 51, 54, 57),
    )
    assert r.all_objects[3].value_span == (r.text.index(' {"desc": "rug') + 1, None)
    assert r.truncated and not r.top_closed and not r.fallback
    assert r.dropped_invalid == 2 and r.obj_total == 4
    assert r.prefix_token_ids == ids[:86] + tok.encode("}")
    assert len(r.prefix_token_ids) == 87
    assert r.prefix_text.endswith('"]}') and not r.prefix_text.endswith("}}")
    assert r.max_object_index_in_prefix == 3
    assert len(r.valid_objects) == 2  # counting valid objects would give 2 and a duplicate object_3


# ------------------------------------------------------------------------------------------------------------
# §20.6


def test_appearance_order_max_index_and_single_closing_brace(tok, cv):
    toks = bbox(2, "dog", [1, 2, 3, 4], first=True) + bbox(1, "cat", [5, 6, 7, 8], close="}}")
    r = parse(tok, cv, toks)
    assert [o.index for o in r.valid_objects] == [2, 1]
    assert r.max_object_index_in_prefix == 2
    assert r.top_closed and not r.truncated
    assert (
        r.prefix_text.endswith('"]}') and r.prefix_text.count("}") == 2
    )  # the two object closes, no top close
    assert r.prefix_token_ids[-1] == tok.id_of("}")


def test_three_bbox_values_dropped_without_repair_neighbours_valid(tok, cv):
    toks = (
        bbox(1, "cat", [1, 2, 3, 4], first=True)
        + bbox(2, "dog", [5, 6, 7])
        + bbox(3, "rug", [8, 9, 10, 11], close="}}")
    )
    r = parse(tok, cv, toks)
    assert [o.index for o in r.valid_objects] == [1, 3]
    bad = r.all_objects[1]
    assert not bad.valid and "3 values" in (bad.reason or "") and bad.bins == ()
    assert r.dropped_invalid == 1
    assert r.text.count("<|coord_") == 11  # nothing repaired or re-serialized


def test_poly_nested_pairs_capture_eight_indices(tok, cv):
    pts = [(10, 10), (20, 10), (20, 20), (10, 20)]
    toks = head(1, "rug", geom="poly", first=True) + [' [["']
    for j, (x, y) in enumerate(pts):
        toks += ([] if j == 0 else ['"],', ' ["']) + [x, '",', ' "', y]
    toks += ['"]]', "}}"]
    r = parse(tok, cv, toks)
    (o,) = r.valid_objects
    assert o.geom_type == "poly" and o.bins == (10, 10, 20, 10, 20, 20, 10, 20)
    assert len(o.coord_token_indices) == 8
    ids = tok.ids_of(toks)
    assert [cv.id_to_bin[ids[j]] for j in o.coord_token_indices] == list(o.bins)


def test_truncated_tail_keeps_complete_objects_and_counts_unclosed_once(tok, cv):
    toks = bbox(1, "cat", [1, 2, 3, 4], first=True) + bbox(2, "dog", [5, 6, 7, 8]) + head(3, "rug") + ["bbox"]
    r = parse(tok, cv, toks)
    assert r.truncated and not r.top_closed
    assert [o.index for o in r.valid_objects] == [1, 2]
    assert r.dropped_invalid == 1 and r.all_objects[2].value_end is None
    assert r.all_objects[2].reason == "object not closed"
    assert r.max_object_index_in_prefix == 2  # object_3's key ends after the cut


def test_truncated_inside_coordinate_list(tok, cv):
    toks = bbox(1, "cat", [1, 2, 3, 4], first=True) + head(2, "dog") + [' ["', 5, '",', ' "', 6]
    r = parse(tok, cv, toks)
    assert [o.index for o in r.valid_objects] == [1]
    assert r.all_objects[1].coord_token_indices == (len(toks) - 4, len(toks) - 1)
    assert r.dropped_invalid == 1 and r.truncated


def test_fused_closing_token_at_cut_is_reencoded_earlier_ids_unchanged(tok, cv):
    toks = bbox(1, "cat", [1, 2, 3, 4], first=True, close="}}")
    ids = tok.ids_of(toks)
    r = parse(tok, cv, toks)
    assert r.prefix_token_ids[:-1] == ids[:-1]
    assert r.prefix_token_ids[-1:] == tok.encode("}")
    assert ids[-1] == tok.id_of("}}")


def test_im_end_hard_stop_removes_everything_after(tok, cv):
    toks = bbox(1, "cat", [1, 2, 3, 4], first=True, close="}}") + ["<|im_end|>", "}", '"', 7, "garbage", "{"]
    r = parse(tok, cv, toks)
    assert r.hard_stopped
    assert r.response_token_ids == tok.ids_of(toks[: toks.index("<|im_end|>")])
    assert "<|im_end|>" not in r.text and "garbage" not in r.text
    assert [o.index for o in r.valid_objects] == [1]


def test_earliest_stop_marker_wins(tok, cv):
    toks = (
        bbox(1, "cat", [1, 2, 3, 4], first=True)
        + ["<|endoftext|>"]
        + bbox(2, "dog", [1, 2, 3, 4])
        + ["<|im_end|>"]
    )
    r = parse(tok, cv, toks)
    assert r.hard_stopped and r.response_token_ids == tok.ids_of(toks[: toks.index("<|endoftext|>")])
    assert [o.index for o in r.valid_objects] == [1]


def test_no_open_brace_falls_back(tok, cv):
    r = parse(tok, cv, ["person", " ", "dog", '"', ":", "<|im_end|>"])
    assert r.fallback and r.truncated and not r.cut_fallback
    assert r.prefix_token_ids == tok.encode("{")
    assert r.prefix_text == "{" and r.valid_objects == [] and r.all_objects == []
    assert r.max_object_index_in_prefix == 0


def test_empty_rollout_falls_back(tok, cv):
    r = parse_rollout([], tok, cv)
    assert_parse_invariants(r, tok, cv)
    assert r.fallback and r.prefix_token_ids == tok.encode("{")


def test_coordinate_written_as_plain_characters_is_invalid(tok, cv):
    toks = bbox(1, "cat", [1, 2, list("<|coord_3|>"), 4], first=True, close="}}")
    r = parse(tok, cv, toks)
    (o,) = r.all_objects
    assert not o.valid and len(o.coord_token_indices) == 3
    assert "3 coordinate tokens captured" in (o.reason or "")


def test_max_index_counts_invalid_objects_in_prefix(tok, cv):
    toks = (
        bbox(1, "cat", [1, 2, 3, 4], first=True)
        + bbox(2, "dog", [1, 2, 3, 4])
        + bbox(3, "rug", [1, 2], close="}}")
    )
    r = parse(tok, cv, toks)
    assert [o.index for o in r.valid_objects] == [1, 2]
    assert r.max_object_index_in_prefix == 3
    assert r.cut_char == r.all_objects[2].value_end


def test_max_index_counts_non_object_values(tok, cv):
    toks = bbox(1, "cat", [1, 2, 3, 4], first=True) + [' "', "object", "_", "9", '":', ' "', "dog", '",']
    toks += bbox(2, "dog", [1, 2, 3, 4], close="}}")
    r = parse(tok, cv, toks)
    assert [o.index for o in r.valid_objects] == [1, 2]
    assert r.max_object_index_in_prefix == 9
    assert [k.key for k in r.object_keys] == ["object_1", "object_9", "object_2"]


def test_multibyte_character_split_across_two_byte_tokens(tok, cv):
    toks = head(1, "", first=True)
    toks[toks.index("")] = CAT[:2]
    toks.insert(toks.index(CAT[:2]) + 1, CAT[2:])
    toks += [' ["', 1, '",', ' "', 2, '",', ' "', 3, '",', ' "', 4, '"]', "}}"]
    ids = tok.ids_of(toks)
    tp = token_pieces(ids, tok)
    j = toks.index(CAT[:2])
    assert tp.pieces[j : j + 2] == ["", "猫"]
    assert tp.span(j) == (tp.starts[j], tp.starts[j] + 1)
    r = parse(tok, cv, toks)
    (o,) = r.valid_objects
    assert o.desc == "猫"
    assert decode_text(tok, r.prefix_token_ids) == r.text[: r.cut_char]


def test_cut_right_after_a_token_that_holds_a_partial_character(tok, cv):
    # '"]}' + first byte of 猫 in one token (piece ""), the rest in the next (piece '"]}猫'):
    # the cut after '}' must not keep the dangling byte (refinement of §6.6; the literal rule would leave
    # '\ufffd' in the prefix).
    toks = head(1, "cat", first=True) + coords([1, 2, 3, 4]) + [b'"]}\xe7', CAT[1:]]
    ids = tok.ids_of(toks)
    tp = token_pieces(ids, tok)
    assert tp.pieces[-2:] == ["", '"]}猫'] and len(ids) - 1 in tp.unclean
    r = parse(tok, cv, toks)
    assert r.prefix_text.endswith('"]}') and decode_text(tok, r.prefix_token_ids) == r.prefix_text
    assert r.prefix_token_ids[: len(ids) - 2] == ids[:-2]
    (o,) = r.valid_objects
    assert o.coord_token_indices[-1] == len(ids) - 3


def test_cut_round_trip_failure_falls_back():
    t = ToyTokenizer(PIECES + ["\t}}"], byte_fallback=False)
    cv = CoordVocab.from_tokenizer(t)
    toks = bbox(1, "cat", [1, 2, 3, 4], first=True, close="\t}}")
    with pytest.raises(CutRoundTripError):
        token_cut(t.ids_of(toks), len(decode_text(t, t.ids_of(toks))) - 1, t)
    results = [
        parse_rollout(t.ids_of(toks), t, cv),
        parse_rollout(t.ids_of(bbox(1, "cat", [1, 2, 3, 4], True, "}}")), t, cv),
    ]
    for r in results:
        assert_parse_invariants(r, t, cv)
    assert sum(r.cut_fallback for r in results) == 1  # rollout/parse_cut_fallback
    bad = results[0]
    assert (
        bad.fallback
        and bad.cut_fallback
        and bad.prefix_token_ids == t.encode("{")
        and bad.valid_objects == []
    )


# ------------------------------------------------------------------------------------------------------------
# Scanner details (§6.3)


def test_text_before_first_brace_stays_in_prefix(tok, cv):
    toks = ["person", ":", " ", '"', "}"] + bbox(1, "cat", [1, 2, 3, 4], first=True, close="}}")
    r = parse(tok, cv, toks)
    assert r.first_open_brace == len('person: "}')
    assert r.prefix_text.startswith('person: "}{"object_1"') and [o.index for o in r.valid_objects] == [1]


def test_no_object_closed_cuts_after_first_brace(tok, cv):
    toks = ['{"', "object", "_", "1", '":', ' {"', "desc"]
    r = parse(tok, cv, toks)
    assert r.cut_char == 1 and r.prefix_text == "{" and r.prefix_token_ids == tok.encode("{")
    assert r.dropped_invalid == 1 and r.max_object_index_in_prefix == 0


def test_structural_characters_inside_strings_are_ignored(tok, cv):
    text = (
        '{"object_1": {"desc": "a \\"}{[,:\\" b", "bbox_2d": '
        '["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}}'
    )
    r = parse_text(tok, cv, text)
    (o,) = r.valid_objects
    assert o.desc == 'a "}{[,:" b'


def test_non_canonical_spacing_is_parsed_by_the_general_path(tok, cv):
    text = '{"object_1":{"bbox_2d":[["<|coord_1|>","<|coord_2|>"],["<|coord_3|>","<|coord_4|>"]],"desc":"x"}}'
    r = parse_text(tok, cv, text)
    (o,) = r.valid_objects
    assert o.bins == (1, 2, 3, 4) and o.geom_type == "bbox_2d"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('{"desc": "a", "bbox_2d": ["<|coord_1|>"], "bbox_2d": ["<|coord_1|>"]}', "duplicate key"),
        ('{"desc": "a", "extra": 1, "bbox_2d": []}', "unexpected keys"),
        ('{"desc": " ", "bbox_2d": []}', "desc"),
        ('{"desc": "a"}', "exactly one"),
        ('{"desc": "a", "bbox_2d": [], "poly": []}', "exactly one"),
        ('{"desc": "a", "bbox_2d": ["<|coord_1|>", ["<|coord_1|>", "<|coord_2|>"]]}', "neither"),
        ('{"desc": "a", "bbox_2d": [1, 2, 3, 4]}', "neither"),
        ('{"desc": "a", "poly": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}', "poly has 4"),
        ('{"desc": "a" "bbox_2d": []}', "not valid JSON"),
    ],
)
def test_object_validation_rules(tok, cv, value, reason):
    r = parse_text(tok, cv, '{"object_1": ' + value + "}")
    (o,) = r.all_objects
    assert not o.valid and reason in (o.reason or "")


def test_nested_garbage_object_is_not_an_object(tok, cv):
    text = '{"meta": {"desc": "a", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}, '
    text += (
        '"object_1": {"desc": "b", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}}'
    )
    r = parse_text(tok, cv, text)
    assert [o.key for o in r.all_objects] == ["object_1"] and r.valid_objects[0].desc == "b"


def test_canonical_fast_path_and_general_path_agree(tok, cv, monkeypatch):
    toks = worked_example_pieces()
    fast = parse_rollout(tok.ids_of(toks), tok, cv)
    monkeypatch.setattr(parse_mod, "_CANONICAL_VALUE_RE", parse_mod.re.compile(r"(?!)"))
    slow = parse_rollout(tok.ids_of(toks), tok, cv)
    assert fast == slow


def test_object_value_inside_a_list_follows_the_scan_rules(tok, cv, monkeypatch):
    # Spec-literal corner: the '{' inside '[' still starts object_1 (pending key), but its inner strings are
    # not keys (bracket depth 1), so nothing is captured and the object is invalid; it still sets the cut.
    text = (
        '{"object_1": [{"desc": "a", "bbox_2d": '
        '["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}]}'
    )
    r = parse_text(tok, cv, text)
    (o,) = r.all_objects
    assert not o.valid and o.coord_token_indices == ()
    assert r.prefix_text == text[:-2]
    monkeypatch.setattr(parse_mod, "_CANONICAL_VALUE_RE", parse_mod.re.compile(r"(?!)"))
    assert parse_rollout(tok.encode(text), tok, cv) == r


def test_parse_never_raises_on_structural_junk(tok, cv):
    junk = ["}", "]", "]", "{", '"', "\\", ":", ",", "[", 5, '{"', "object", "_", "1", '":', ' {"', "}}"]
    for k in range(len(junk) + 1):
        r = parse(tok, cv, junk[:k] + junk[::-1][: len(junk) - k])
        assert r.dropped_invalid == len(r.all_objects) - len(r.valid_objects)


def test_coord_ids_that_do_not_spell_their_strings_are_checked_against_the_text(tok, cv):
    # The fast canonical path may take the captured bins as the written ones only when every coordinate id
    # decodes to its own "<|coord_k|>"; with a vocab whose ids are rotated by one bin it must read the text.
    rotated = CoordVocab.from_ids(cv.ids[1:] + cv.ids[:1])
    ids = tok.ids_of(bbox(1, "cat", [10, 20, 30, 40], first=True, close="}}"))
    good, bad = parse_rollout(ids, tok, cv), parse_rollout(ids, tok, rotated)
    assert [o.bins for o in good.valid_objects] == [(10, 20, 30, 40)]
    assert bad.valid_objects == [] and "differ from the written values" in bad.all_objects[0].reason

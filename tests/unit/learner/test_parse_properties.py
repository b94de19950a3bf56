"""Property tests of the parser on the real tiny tokenizer (docs/ALGORITHM.md#parsing, §6.9, §10
separators)."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from learner.stage2.coords import CoordVocab
from learner.stage2.format import serialize_entry, serialize_objects
from learner.stage2.gt import GTObject
from learner.stage2.parse import parser as parse_mod
from learner.stage2.parse.detok import _Detokenizer, decode_text, encode_text, token_pieces
from learner.stage2.parse.parser import CutRoundTripError, parse_rollout, token_cut
from tests.unit.learner.parse_checks import assert_parse_invariants

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORDS = ["person", "cat", "dog", "rug", "sofa", "unknown", "red car", "猫", "chat noir", 'a"b', "x\\y", "é"]

bins = st.integers(0, 999)
descs = st.one_of(
    st.sampled_from(WORDS),
    # NFC-stable text:
    # Qwen tokenizers NFC-normalize on encode, and a rollout only holds what the model emitted.
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), min_size=1, max_size=8)
    .map(lambda s: unicodedata.normalize("NFC", s))
    .filter(lambda s: s.strip() and "<|" not in s),
)
bbox_geom = st.tuples(st.just("bbox_2d"), st.lists(bins, min_size=4, max_size=4))
poly_geom = st.tuples(
    st.just("poly"), st.lists(bins, min_size=6, max_size=16).filter(lambda b: len(b) % 2 == 0)
)
gt_objects = st.lists(st.tuples(descs, st.one_of(bbox_geom, poly_geom)), max_size=60).map(
    lambda objs: [GTObject(j + 1, d, g, tuple(b)) for j, (d, (g, b)) in enumerate(objs)]
)


@pytest.fixture(scope="module")
def cv(tiny_tokenizer) -> CoordVocab:
    return CoordVocab.from_tokenizer(tiny_tokenizer)


def _no_dup(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys {keys}"
    return dict(pairs)


def _as_tuple(value: dict) -> tuple:
    ((geom, coords),) = [(k, v) for k, v in value.items() if k != "desc"]
    flat = [c for p in coords for c in p] if coords and isinstance(coords[0], list) else coords
    return value["desc"], geom, tuple(int(c[len("<|coord_") : -2]) for c in flat)


@SETTINGS
@given(objs=gt_objects, end=st.sampled_from(["", "<|im_end|>", "<|im_end|>\n junk"]))
def test_serialized_objects_are_recovered_exactly(tiny_tokenizer, cv, objs, end):
    tok = tiny_tokenizer
    assume(unicodedata.normalize("NFC", serialize_objects(objs)) == serialize_objects(objs))
    ids = encode_text(tok, serialize_objects(objs) + end)
    r = parse_rollout(ids, tok, cv)
    assert_parse_invariants(r, tok, cv)
    assert not r.truncated and r.top_closed and not r.fallback and r.dropped_invalid == 0
    assert [(o.index, o.desc, o.geom_type, o.bins) for o in r.valid_objects] == [
        (g.index, g.desc, g.geom_type, g.bins) for g in objs
    ]
    coord_positions = [i for i, t in enumerate(r.response_token_ids) if t in cv.id_to_bin]
    assert [j for o in r.valid_objects for j in o.coord_token_indices] == coord_positions
    assert r.max_object_index_in_prefix == len(objs)
    assert r.prefix_text == (serialize_objects(objs)[:-1] if objs else "{")


@SETTINGS
@given(objs=gt_objects, data=st.data())
def test_truncation_anywhere_gives_a_completable_prefix(tiny_tokenizer, cv, objs, data):
    tok = tiny_tokenizer
    assume(unicodedata.normalize("NFC", serialize_objects(objs)) == serialize_objects(objs))
    ids = encode_text(tok, serialize_objects(objs))
    cuts = {0, len(ids)} | set(data.draw(st.lists(st.integers(0, len(ids)), min_size=4, max_size=8)))
    for k in sorted(cuts):
        r = parse_rollout(ids[:k], tok, cv)
        assert_parse_invariants(r, tok, cv)
        for o in r.valid_objects:
            g = objs[o.index - 1]
            assert (o.desc, o.geom_type, o.bins) == (g.desc, g.geom_type, g.bins)
        recovered = {o.index for o in r.valid_objects}
        missing = [g for g in objs if g.index not in recovered]
        last = r.prefix_text.rstrip()[-1]
        sep = ", " if last == "}" else ""
        entries = [
            serialize_entry(r.max_object_index_in_prefix + 1 + j, g.desc, g.geom_type, g.bins)
            for j, g in enumerate(missing)
        ]
        append = (sep + ", ".join(entries) + "}") if entries else "}"
        y_ids = r.prefix_token_ids + encode_text(tok, append)
        y_text = decode_text(tok, y_ids)
        assert y_text == r.prefix_text + append
        start = r.first_open_brace or 0
        value = json.loads(y_text[start:], object_pairs_hook=_no_dup)
        got = sorted(_as_tuple(v) for v in value.values())
        assert got == sorted((g.desc, g.geom_type, g.bins) for g in objs)


STRUCTURAL = [
    '{"',
    '":',
    ' {"',
    '",',
    ' "',
    " [",
    '"]',
    '"]]',
    " [[",
    "},",
    "}}",
    "{",
    "}",
    "[",
    "]",
    '"',
    ",",
    ":",
]
STRUCTURAL += ["object", "_", "1", "2", "desc", "bbox", "poly", "cat", "\\", " ", "<|im_end|>"]


def general_path_parse(ids: list[int], tok, cv: CoordVocab):
    """`parse_rollout` with the canonical fast path off (its matcher never matches): the general path only."""
    orig = parse_mod._CANONICAL_VALUE_RE
    parse_mod._CANONICAL_VALUE_RE = parse_mod.re.compile(r"(?!)")
    try:
        return parse_rollout(ids, tok, cv)
    finally:
        parse_mod._CANONICAL_VALUE_RE = orig


@pytest.fixture(scope="module")
def junk_pool(tiny_tokenizer, cv) -> list[int]:
    pool = sorted({t for s in STRUCTURAL for t in encode_text(tiny_tokenizer, s)})
    pool += list(cv.ids[:8]) + encode_text(tiny_tokenizer, "猫é")  # byte-fragment tokens of multi-byte chars
    return pool


@SETTINGS
@given(data=st.data())
def test_parser_never_raises_on_junk_and_both_value_paths_agree(tiny_tokenizer, cv, junk_pool, data):
    tok = tiny_tokenizer
    ids = data.draw(st.lists(st.sampled_from(junk_pool), max_size=200))
    prefix = data.draw(st.sampled_from(["", '{"object_1": {"desc": "a", "bbox_2d": [', '{"object_1": ']))
    ids = encode_text(tok, prefix) + ids
    r = parse_rollout(ids, tok, cv)
    assert_parse_invariants(r, tok, cv)
    assert general_path_parse(ids, tok, cv) == r


@SETTINGS
@given(objs=gt_objects.filter(bool))
def test_canonical_fast_path_matches_general_path(tiny_tokenizer, cv, objs):
    tok = tiny_tokenizer
    ids = encode_text(tok, serialize_objects(objs))
    ids = ids[: random.Random(len(ids)).randint(0, len(ids))]
    fast = parse_rollout(ids, tok, cv)
    assert general_path_parse(ids, tok, cv) == fast


@SETTINGS
@given(data=st.data())
def test_pieces_join_to_decode_and_token_cut_keeps_text(tiny_tokenizer, data):
    tok = tiny_tokenizer
    ids = data.draw(st.lists(st.integers(0, len(tok) + 19), max_size=120))
    tp = token_pieces(ids, tok)
    assert tp.text == decode_text(tok, ids)
    assert all(e - s == len(p) for s, e, p in zip(tp.starts, tp.ends, tp.pieces, strict=True))
    for c in data.draw(st.lists(st.integers(0, len(tp.text)), max_size=5)):
        try:
            cut = token_cut(ids, c, tok, tp)
        except CutRoundTripError:
            continue
        assert decode_text(tok, cut) == tp.text[:c]


@SETTINGS
@given(
    text=st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), max_size=40).map(
        lambda s: unicodedata.normalize("NFC", s)
    )
)
def test_byte_table_and_prefix_decoding_give_the_same_pieces(tiny_tokenizer, text):
    tok = tiny_tokenizer
    ids = encode_text(tok, text)
    slow = _Detokenizer(tok)
    slow.byte_fn = None
    assert slow.pieces(ids) == (token_pieces(ids, tok).pieces, token_pieces(ids, tok).unclean)

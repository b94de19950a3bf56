"""Memoized and segmented encoding equal the plain encode (learner/stage2/parse/encode_cache.py;
docs/ALGORITHM.md#token-cut, §10)."""

from __future__ import annotations

import random

import pytest

from learner.stage2.format import serialize_entry
from learner.stage2.parse.detok import decode_text, encode_text
from learner.stage2.parse.encode_cache import _encoder, encode_cached, encode_roundtrip, encode_segmented
from tests.unit.learner.worked_example import make_tokenizer

DESCS = [
    "person",
    "traffic light",
    "猫",
    'a"b',
    "x\\y",
    "é",
    " lead",
    "<|im_end|>",
    "<|coord_5",
    "5|>",
    "<|coord_01|>",
]


def _tail(rng: random.Random) -> str:
    entries = []
    for n in range(rng.randint(0, 6)):
        geom = rng.choice(["bbox_2d", "poly"])
        bins = [rng.randint(0, 999) for _ in range(4 if geom == "bbox_2d" else 2 * rng.randint(3, 6))]
        entries.append(serialize_entry(n + rng.randint(1, 80), rng.choice(DESCS), geom, bins))
    return rng.choice(["", ", "]) + ", ".join(entries) + "}"


def test_segmented_encoding_is_the_plain_encoding(tiny_tokenizer) -> None:
    assert _encoder(tiny_tokenizer).coord_ids is not None  # the fast path is really taken
    rng = random.Random(0)
    texts = [_tail(rng) for _ in range(200)]
    texts += [
        "<|coord_1|><|coord_2|>",  # adjacent coordinate tokens
        "<|coord_1000|> <|coord_007|> <|coord_9|>",  # coordinate-like strings that are not added tokens
        '"<|coord_12|>"<|im_end|><|coord_3|>\n',
        "",
    ]
    for text in texts:
        want = encode_text(tiny_tokenizer, text)
        assert encode_segmented(tiny_tokenizer, text) == want, text
        assert encode_segmented(tiny_tokenizer, text) == want, text  # again, from the cache


def test_cached_and_roundtrip_encodings(tiny_tokenizer) -> None:
    for text in ["}", '"]}', '", "', "猫", "\u00e9", "<|coord_5|>", "x" * 300]:
        ids = encode_text(tiny_tokenizer, text)
        for _ in range(2):
            assert encode_cached(tiny_tokenizer, text) == ids
            assert encode_roundtrip(tiny_tokenizer, text) == (ids, decode_text(tiny_tokenizer, ids))
    got = encode_cached(tiny_tokenizer, "}")
    got.append(-1)  # callers own the returned list
    assert encode_cached(tiny_tokenizer, "}") == encode_text(tiny_tokenizer, "}")


def test_tokenizers_without_a_fast_backend_encode_whole() -> None:
    tok = make_tokenizer()
    assert _encoder(tok).coord_ids is None
    rng = random.Random(1)
    for _ in range(20):
        text = _tail(rng)
        assert encode_segmented(tok, text) == encode_text(tok, text)


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word", "normalized"])
def test_coordinate_tokens_with_flags_disable_the_split(tiny_tokenizer, flag) -> None:
    class Tok:
        backend_tokenizer = object()
        split_special_tokens = False

        def __init__(self) -> None:
            self.added_tokens_decoder = dict(tiny_tokenizer.added_tokens_decoder)
            tid, tok = next(
                (i, t) for i, t in self.added_tokens_decoder.items() if t.content == "<|coord_7|>"
            )
            self.added_tokens_decoder[tid] = type(tok)(tok.content, **{**_flags(tok), flag: True})

        def encode(self, text, add_special_tokens=False):
            return tiny_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    assert _encoder(Tok()).coord_ids is None


def _flags(tok) -> dict:
    return {k: getattr(tok, k) for k in ("lstrip", "rstrip", "single_word", "normalized", "special")}


def test_added_tokens_that_could_swallow_a_coordinate_edge_are_detected() -> None:
    from learner.stage2.parse.encode_cache import _crosses_coord_edge

    assert not _crosses_coord_edge("<|im_end|>")
    assert not _crosses_coord_edge("|>x")  # starts inside a coordinate token: the coordinate token wins
    for content in ['"<', "x<|", "a<|coord", "<|coord_12|>x", "q<|coord_3|"]:
        assert _crosses_coord_edge(content), content

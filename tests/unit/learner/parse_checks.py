"""Invariant checks shared by the parser tests (docs/ALGORITHM.md#parsing §6.9)."""

from __future__ import annotations

from typing import Any

from learner.stage2.coords import CoordVocab
from learner.stage2.parse.detok import decode_text
from learner.stage2.parse.parser import ParseResult


def assert_parse_invariants(r: ParseResult, tok: Any, coord_vocab: CoordVocab) -> None:
    """Every §6.9 invariant (the §6.4 fallback's prefix is the synthetic ``encode("{")``)."""
    assert decode_text(tok, r.response_token_ids) == r.text
    assert "".join(r.pieces.pieces) == r.text
    assert decode_text(tok, r.prefix_token_ids) == r.prefix_text
    assert r.prefix_pieces.text == r.prefix_text
    assert len(r.prefix_pieces) == len(r.prefix_token_ids)
    assert r.dropped_invalid == len(r.all_objects) - len(r.valid_objects)
    if r.fallback:
        assert r.prefix_text == "{"
        assert r.valid_objects == [] and r.max_object_index_in_prefix == 0 and r.truncated
        return
    assert r.prefix_text == r.text[: r.cut_char]
    assert r.prefix_text.rstrip().endswith(("{", "}"))
    starts = [o.value_start for o in r.valid_objects]
    assert starts == sorted(starts)
    for o in r.valid_objects:
        assert len(o.coord_token_indices) == len(o.bins)
        assert o.value_end is not None and o.value_end <= r.cut_char
        for j, b in zip(o.coord_token_indices, o.bins, strict=True):
            assert j < len(r.prefix_token_ids)
            assert r.prefix_token_ids[j] == r.response_token_ids[j] == coord_vocab.ids[b]

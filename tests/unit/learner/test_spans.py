"""Desc-overlapping tail tokens (docs/ALGORITHM.md#ce-masks; learner/stage2/targets/spans.py)."""

from __future__ import annotations

import random

import numpy as np

from learner.stage2.targets.spans import char_spans, desc_overlapping_tokens, find_desc_value_spans


def _reference(pieces: list[str]) -> list[int]:
    """The definition: a char mask of the desc values;
    a token overlaps if its §6.1 range holds a masked char."""
    text = "".join(pieces)
    mask = np.zeros(len(text) + 1, dtype=bool)
    for s, e in find_desc_value_spans(text):
        mask[s:e] = True
    return [k for k, (s, e) in enumerate(char_spans(pieces)) if mask[s : min(e, len(mask))].any()]


def test_bisection_agrees_with_the_char_mask() -> None:
    rng = random.Random(0)
    alphabet = [
        '"desc"',
        ": ",
        '"',
        "a",
        "bc",
        "\\",
        '\\"',
        ", ",
        "{",
        "}",
        "",
        '"desc":"',
        " ",
        "é",
        '"desc" :  "x',
    ]
    for _ in range(20000):
        pieces = [
            rng.choice(alphabet)
            if rng.random() < 0.7
            else "".join(rng.choices(alphabet, k=rng.randint(1, 4)))
            for _ in range(rng.randint(0, 25))
        ]
        assert desc_overlapping_tokens(pieces) == _reference(pieces), pieces


def test_empty_desc_and_empty_pieces() -> None:
    assert desc_overlapping_tokens(['{"desc": "', '"', "}"]) == []
    # an empty piece (a token ending inside a character) occupies one char for overlap tests
    assert desc_overlapping_tokens(['{"desc": "', "", "ab", '"}']) == [1, 2]

"""Character spans behind the CE masks (docs/ALGORITHM.md#ce-masks, §12.3).

- desc value spans of a text (§12.2) and the tokens overlapping them (``tail_ignore_pos``);
- prefix tokens eligible for CE under ``prefix_structure_ce`` (§12.3).

Token char ranges follow §6.1: an empty piece (a token ending inside a multi-byte character)
occupies ``[start, start + 1)`` for overlap tests.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from learner.stage2.coords import CoordVocab

if TYPE_CHECKING:
    from learner.stage2.parse.parser import ParseResult

__all__ = ["char_spans", "desc_overlapping_tokens", "find_desc_value_spans", "prefix_ce_positions"]

_DESC_OPEN = re.compile(r'"desc"\s*:\s*"')


def find_desc_value_spans(text: str) -> list[tuple[int, int]]:
    """Char spans ``[start, end)`` of desc value contents, quotes excluded (§12.2).

    Every match of ``"desc"\\s*:\\s*"`` opens a value running to the next unescaped ``"`` (or to the
    end of the text when unterminated). Scanning resumes after the value, so text inside a value is
    never taken for a key.
    """
    spans: list[tuple[int, int]] = []
    pos = 0
    n = len(text)
    while True:
        m = _DESC_OPEN.search(text, pos)
        if m is None:
            return spans
        i = m.end()
        while i < n and text[i] != '"':
            i += 2 if text[i] == "\\" else 1
        end = min(i, n)
        spans.append((m.end(), end))
        pos = end + 1


def char_spans(pieces: Sequence[str]) -> list[tuple[int, int]]:
    """Per-token char range for overlap tests; an empty piece occupies ``[start, start + 1)`` (§6.1)."""
    out = []
    pos = 0
    for p in pieces:
        out.append((pos, pos + max(len(p), 1)))
        pos += len(p)
    return out


def _mask_of(spans: Iterable[tuple[int, int]], n: int) -> np.ndarray:
    m = np.zeros(n + 1, dtype=bool)  # +1: empty pieces at the very end
    for s, e in spans:
        m[s:e] = True
    return m


def desc_overlapping_tokens(pieces: Sequence[str]) -> list[int]:
    """Indices of tokens whose char range overlaps a desc value of ``"".join(pieces)`` (§12.2).

    Token ``i`` overlaps a non-empty span ``[a, b)`` iff ``start_i < b`` and ``end_i > a`` (``end_i`` being
    the §6.1 overlap end, ``start_i + 1`` for an empty piece). Both ends are non-decreasing in ``i``, so each
    span's tokens are one index range found by bisection; spans are sorted and disjoint, so the ranges come in
    order (consecutive ranges may share a token that straddles two spans: it is listed once).
    """
    spans = [(a, b) for a, b in find_desc_value_spans("".join(pieces)) if b > a]
    if not spans:
        return []
    ends = list(itertools.accumulate(map(len, pieces)))
    starts = [0, *ends[:-1]]
    if "" in pieces:
        ends = [e if e > s else s + 1 for s, e in zip(starts, ends, strict=True)]
    out: list[int] = []
    done = 0
    for a, b in spans:
        lo = max(bisect.bisect_right(ends, a), done)
        done = max(bisect.bisect_left(starts, b), lo)
        out.extend(range(lo, done))
    return out


def prefix_ce_positions(parse: ParseResult, tp_preds: Sequence[int], coord_vocab: CoordVocab) -> list[int]:
    """Prefix token indices that get CE under ``prefix_structure_ce`` (§12.3).

    Eligible characters: the first ``{``; the entry ``[key_start_char, value_end)`` of every TP object;
    the separator characters between two TP entries that follow each other with no other top-level key
    in between. A token qualifies iff all its characters are eligible, it is not a coord token and it
    does not overlap a desc value span.

    Args:
        parse: the sample's parse result (``prefix_text``, ``prefix_pieces``, ``object_keys``).
        tp_preds: indices into ``parse.valid_objects`` of the TP predictions.
        coord_vocab: coord-token lookup.
    """
    text = parse.prefix_text
    n = len(text)
    eligible = np.zeros(n + 1, dtype=bool)  # slot n: empty pieces at the very end are never eligible
    first = text.find("{")
    if first >= 0:
        eligible[first] = True
    objs = parse.valid_objects
    tp_key_starts = {objs[i].key_start_char for i in tp_preds}
    key_starts = sorted(k.start for k in parse.object_keys)
    for i in tp_preds:
        start, end = objs[i].key_start_char, objs[i].value_span[1]
        eligible[start:end] = True
        nxt = bisect.bisect_left(key_starts, end)
        if nxt < len(key_starts) and key_starts[nxt] in tp_key_starts:
            eligible[end : key_starts[nxt]] = True
    eligible[n] = False
    desc = _mask_of(find_desc_value_spans(text), n)
    cs_ok = np.concatenate([[0], np.cumsum(eligible)]).tolist()
    cs_desc = np.concatenate([[0], np.cumsum(desc)]).tolist()
    ids = parse.prefix_token_ids
    out = []
    for k, (s, e) in enumerate(char_spans(parse.prefix_pieces.pieces)):
        s, e = min(s, n + 1), min(e, n + 1)
        if (
            e > s
            and cs_ok[e] - cs_ok[s] == e - s
            and cs_desc[e] == cs_desc[s]
            and not coord_vocab.is_coord(ids[k])
        ):
            out.append(k)
    return out

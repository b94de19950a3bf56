"""Presence and free-text rewards of the summary task (docs/ALGORITHM.md#rewards: group_stats_presence,
notes_presence, text_bbu, notes_bbu).

Strings are compared after :func:`normalize` (NFKC, every whitespace character removed).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from typing import Any

from learner.rewards.summary_parse import (
    GROUP_STATS_KEY,
    NOTES_KEY,
    TEXT_KEY,
    SummarySample,
    category_entries,
    pred_and_ref,
)

_WHITESPACE = re.compile(r"\s+")
_CLAUSE_SPLIT = re.compile(r"[，,；;。\n]")

TEXT_OVERFLOW_WEIGHT = 0.5


def normalize(text: str) -> str:
    """NFKC, then every whitespace character removed."""
    return _WHITESPACE.sub("", unicodedata.normalize("NFKC", text))


def _non_empty(value: Any) -> bool:
    """Presence test of ``分组统计`` / ``备注``: blank strings and empty containers count as absent."""
    if value is None:
        return False
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, dict | list):
        return bool(value)
    return True


def _presence_match(sample: SummarySample, key: str) -> float:
    pair = pred_and_ref(sample)
    if pair is None:
        return 0.0
    pred, ref = pair
    return 1.0 if _non_empty(pred.get(key)) == _non_empty(ref.get(key)) else 0.0


def group_stats_presence_reward(sample: SummarySample) -> float:
    """``summary.group_stats_presence``: 1.0 iff pred and ref agree on having a non-empty ``分组统计``."""
    return _presence_match(sample, GROUP_STATS_KEY)


def notes_presence_reward(sample: SummarySample) -> float:
    """``summary.notes_presence``: 1.0 iff pred and ref agree on having a non-empty ``备注``."""
    return _presence_match(sample, NOTES_KEY)


def ocr_strings(obj: dict[str, Any]) -> Counter[str]:
    """Multiset of normalized ``文本`` values inside categories.

    A string counts once, a list counts each of its strings, an object counts each key ``count`` times
    (an int count; any other value counts the key once).
    """
    out: Counter[str] = Counter()
    for _, attrs in category_entries(obj):
        value = attrs.get(TEXT_KEY)
        if isinstance(value, str):
            out[normalize(value)] += 1
        elif isinstance(value, list):
            out.update(normalize(item) for item in value if isinstance(item, str))
        elif isinstance(value, dict):
            for key, count in value.items():
                is_int = isinstance(count, int) and not isinstance(count, bool)
                repeats = max(0, count) if is_int else 1
                if repeats:
                    out[normalize(key)] += repeats
    return out


def text_bbu_reward(sample: SummarySample) -> float:
    """``summary.text_bbu`` (BBU only): ``clip(recall − 0.5·overflow, −1, 1)`` over OCR string multisets.

    ``recall = #(pred ∩ ref) / #ref``, ``overflow = max(0, #pred − #ref) / #ref``; no reference strings →
    1.0 iff none predicted.
    """
    pair = pred_and_ref(sample)
    if pair is None or sample.row.domain != "BBU":
        return 0.0
    pred, ref = (ocr_strings(obj) for obj in pair)
    n_pred, n_ref = sum(pred.values()), sum(ref.values())
    if n_ref == 0:
        return 1.0 if n_pred == 0 else 0.0
    recall = sum((pred & ref).values()) / n_ref
    overflow = max(0, n_pred - n_ref) / n_ref
    return max(-1.0, min(1.0, recall - TEXT_OVERFLOW_WEIGHT * overflow))


def note_clauses(obj: dict[str, Any]) -> set[str]:
    """Normalized non-empty clauses of the top-level ``备注`` (a string or a list of strings)."""
    notes = obj.get(NOTES_KEY)
    if isinstance(notes, str):
        texts = [notes]
    elif isinstance(notes, list):
        texts = [item for item in notes if isinstance(item, str)]
    else:
        texts = []
    clauses = (normalize(part) for text in texts for part in _CLAUSE_SPLIT.split(text))
    return {clause for clause in clauses if clause}


def notes_bbu_reward(sample: SummarySample) -> float:
    """``summary.notes_bbu`` (BBU only): set recall of ``备注`` clauses.

    No reference clause → 1.0 iff none predicted."""
    pair = pred_and_ref(sample)
    if pair is None or sample.row.domain != "BBU":
        return 0.0
    pred, ref = (note_clauses(obj) for obj in pair)
    if not ref:
        return 1.0 if not pred else 0.0
    return len(pred & ref) / len(ref)

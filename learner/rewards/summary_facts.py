"""Fact-based content rewards of the summary task (docs/ALGORITHM.md#facts-and-tversky: facts, Tversky,
content_f1; §5 content_eq).

A fact is ``(category, path, value)`` with an integer count; facts come from ``统计`` only, read per entry
(unmerged) so that counts of equal facts add up across entries of one category.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from learner.rewards.summary_parse import (
    STATS_KEY,
    TEXT_KEY,
    SummarySample,
    category_entries,
    pred_and_ref,
)

Fact = tuple[str, str, str]

TVERSKY_ALPHA: dict[str, float] = {"BBU": 0.3, "RRU": 0.6}
"""False-positive weight per domain (§5: α = 0.3 for BBU, 0.6 for RRU); unlisted domains use the RRU value."""
TVERSKY_BETA = 1.0


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _walk(category: str, path: str, value: Any, out: Counter[Fact]) -> None:
    """Adds the facts of one attribute value (the ``walk`` of §5.2) to ``out``."""
    if isinstance(value, dict):
        for key, child in value.items():
            if _is_count(child):
                if child > 0:
                    out[(category, path, key)] += child
            elif isinstance(child, dict | list):
                _walk(category, f"{path}/{key}", child, out)
            else:
                out[(category, f"{path}/{key}", str(child))] += 1
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict | list):
                _walk(category, path, item, out)
            else:
                out[(category, path, str(item))] += 1
    else:
        out[(category, path, str(value))] += 1


def facts(obj: dict[str, Any], domain: str) -> Counter[Fact]:
    """The fact multiset of a summary object; ``文本`` is skipped for BBU (its OCR is scored by text_bbu)."""
    out: Counter[Fact] = Counter()
    for category, attrs in category_entries(obj):
        for key, value in attrs.items():
            if domain == "BBU" and key == TEXT_KEY:
                continue
            _walk(category, key, value, out)
    return out


def overlap_counts(pred: Counter[Fact], ref: Counter[Fact]) -> tuple[int, int, int]:
    """``(O, FP, FN)`` of two fact multisets: ``Σ min``, ``Σ max(0, P − R)``, ``Σ max(0, R − P)``."""
    overlap = sum((pred & ref).values())
    return overlap, sum((pred - ref).values()), sum((ref - pred).values())


def tversky(overlap: int, fp: int, fn: int, alpha: float, beta: float = TVERSKY_BETA) -> float:
    """``O / (O + α·FP + β·FN)``; 1.0 when both multisets are empty."""
    denominator = overlap + alpha * fp + beta * fn
    return 1.0 if denominator == 0 else overlap / denominator


def content_structured_tversky_reward(sample: SummarySample) -> float:
    """``summary.content_structured_tversky``: Tversky index of the fact multisets (α by domain, β = 1)."""
    pair = pred_and_ref(sample)
    if pair is None:
        return 0.0
    domain = sample.row.domain
    counts = overlap_counts(facts(pair[0], domain), facts(pair[1], domain))
    return tversky(*counts, alpha=TVERSKY_ALPHA.get(domain, TVERSKY_ALPHA["RRU"]))


def content_f1_reward(sample: SummarySample) -> float:
    """``summary.content_f1``: ``2·O / (2·O + FP + FN)`` over the facts; both empty → 1.0."""
    pair = pred_and_ref(sample)
    if pair is None:
        return 0.0
    domain = sample.row.domain
    overlap, fp, fn = overlap_counts(facts(pair[0], domain), facts(pair[1], domain))
    denominator = 2 * overlap + fp + fn
    return 1.0 if denominator == 0 else 2 * overlap / denominator


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def canonical(obj: dict[str, Any]) -> str:
    """Order-insensitive serialization: keys sorted, ``统计`` entries sorted by their own canonical string."""
    stats = obj.get(STATS_KEY)
    if isinstance(stats, list):
        obj = {**obj, STATS_KEY: sorted(stats, key=_canonical_json)}
    return _canonical_json(obj)


def content_eq_reward(sample: SummarySample) -> float:
    """``summary.content_eq``: 1.0 iff the canonical prediction equals the canonical reference."""
    pair = pred_and_ref(sample)
    if pair is None:
        return 0.0
    return 1.0 if canonical(pair[0]) == canonical(pair[1]) else 0.0

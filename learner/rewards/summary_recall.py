"""Category and attribute recall rewards of the summary task (docs/ALGORITHM.md#rewards: category_recall,
attr_key_recall, attr_path_recall, category_f1).

All are set-based and read the merged categories of §4.3; irrelevant rows and unparseable predictions
score 0.0.
"""

from __future__ import annotations

from typing import Any

from learner.rewards.summary_parse import TEXT_KEY, SummarySample, categories, is_digits, pred_and_ref

PATH_PARENTS: frozenset[str] = frozenset(
    {
        "捆扎",
        "可见性",
        "符合性",
        "弯曲半径",
        "套管保护",
        "保护",
        "保护措施",
        "位置",
        "安装状态",
        "方向",
        "安装方向",
    }
)
"""Attributes whose child keys form the ``parent/child`` paths of ``summary.attr_path_recall``."""

MAX_PATH_CHILD_CHARS = 32


def category_recall_reward(sample: SummarySample) -> float:
    """``summary.category_recall``: ``#(P ∩ R) / #R`` of category names; empty ``R`` → 1.0 iff ``P`` empty."""
    pair = pred_and_ref(sample)
    if pair is None:
        return 0.0
    pred, ref = (set(categories(obj)) for obj in pair)
    if not ref:
        return 1.0 if not pred else 0.0
    return len(pred & ref) / len(ref)


def category_f1_reward(sample: SummarySample) -> float:
    """``summary.category_f1``: F1 of the category sets; both empty → 1.0, exactly one empty → 0.0."""
    pair = pred_and_ref(sample)
    if pair is None:
        return 0.0
    pred, ref = (set(categories(obj)) for obj in pair)
    if not pred and not ref:
        return 1.0
    return 2 * len(pred & ref) / (len(pred) + len(ref))


def _attr_keys(attrs: dict[str, Any]) -> set[str]:
    return {key for key in attrs if key != TEXT_KEY}


def attr_key_recall_reward(sample: SummarySample) -> float:
    """``summary.attr_key_recall``: mean attribute-key recall over reference categories (``文本`` excluded).

    Every reference category with a non-empty key set weighs the same; a missing predicted category
    recalls nothing. No reference category → 1.0 iff no predicted category; reference categories all
    without keys → 1.0.
    """
    pair = pred_and_ref(sample)
    if pair is None:
        return 0.0
    pred, ref = (categories(obj) for obj in pair)
    if not ref:
        return 1.0 if not pred else 0.0
    recalls = []
    for name, attrs in ref.items():
        ref_keys = _attr_keys(attrs)
        if ref_keys:
            pred_keys = _attr_keys(pred.get(name, {}))
            recalls.append(len(pred_keys & ref_keys) / len(ref_keys))
    return sum(recalls) / len(recalls) if recalls else 1.0


def attr_paths(attrs: dict[str, Any]) -> set[str]:
    """The ``parent/child`` paths of one merged category entry (rule of ``summary.attr_path_recall``)."""
    paths = set()
    for parent, value in attrs.items():
        if parent not in PATH_PARENTS or not isinstance(value, dict):
            continue
        for child in value:
            if not is_digits(child) and "=" not in child and len(child) <= MAX_PATH_CHILD_CHARS:
                paths.add(f"{parent}/{child}")
    return paths


def attr_path_recall_reward(sample: SummarySample) -> float:
    """``summary.attr_path_recall``: mean path recall over categories in ``P ∩ R`` with reference paths.

    No such category → 1.0 when the reference has no paths at all, else 0.0.
    """
    pair = pred_and_ref(sample)
    if pair is None:
        return 0.0
    pred, ref = (categories(obj) for obj in pair)
    recalls = []
    for name in (n for n in ref if n in pred):  # reference order keeps the float sum reproducible
        ref_paths = attr_paths(ref[name])
        if ref_paths:
            recalls.append(len(attr_paths(pred[name]) & ref_paths) / len(ref_paths))
    if recalls:
        return sum(recalls) / len(recalls)
    ref_has_paths = any(attr_paths(attrs) for attrs in ref.values())
    return 0.0 if ref_has_paths else 1.0

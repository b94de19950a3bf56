"""Rewards by name, the preset weights and the total reward (docs/ALGORITHM.md#total-reward, §5.3).

Two tasks: the summary rewards (``summary.*``, pure ``(SummarySample) -> float``) and the detection rewards
(``detection.*``, pure ``(DetectionSample) -> float``, ``learner.rewards.detection``: stage-2 parse + GT +
Hungarian match). :func:`total_reward` parses each completion once per task that a named reward belongs to and
evaluates the rewards named in ``weights`` (weight 0 means "logged, not optimized").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from learner.rewards.detection import (
    DetectionSample,
    DetectionScorer,
    count_reward,
    detection_samples,
    f1_iou50_reward,
    f1_reward,
    maskiou_reward,
    no_duplicates_reward,
    precision_reward,
    recall_reward,
)
from learner.rewards.detection import format_reward as detection_format_reward
from learner.rewards.summary_facts import (
    content_eq_reward,
    content_f1_reward,
    content_structured_tversky_reward,
)
from learner.rewards.summary_format import (
    dataset_reward,
    format_reward,
    header_reward,
    no_dup_keys_reward,
    parse_reward,
    strict_reward,
)
from learner.rewards.summary_parse import SummarySample, make_row, make_sample
from learner.rewards.summary_recall import (
    attr_key_recall_reward,
    attr_path_recall_reward,
    category_f1_reward,
    category_recall_reward,
)
from learner.rewards.summary_schema import SummarySchemas, schema_tree_reward
from learner.rewards.summary_text import (
    group_stats_presence_reward,
    notes_bbu_reward,
    notes_presence_reward,
    text_bbu_reward,
)

SampleReward = Callable[[SummarySample], float]
DetectionReward = Callable[[DetectionSample], float]

SCHEMA_TREE = "summary.schema_tree"

SUMMARY_REWARDS: Mapping[str, SampleReward] = {
    "summary.format": format_reward,
    "summary.header": header_reward,
    "summary.strict": strict_reward,
    "summary.parse": parse_reward,
    "summary.no_dup_keys": no_dup_keys_reward,
    "summary.dataset": dataset_reward,
    "summary.category_recall": category_recall_reward,
    "summary.attr_key_recall": attr_key_recall_reward,
    "summary.attr_path_recall": attr_path_recall_reward,
    "summary.content_structured_tversky": content_structured_tversky_reward,
    "summary.content_f1": content_f1_reward,
    "summary.category_f1": category_f1_reward,
    "summary.content_eq": content_eq_reward,
    "summary.group_stats_presence": group_stats_presence_reward,
    "summary.notes_presence": notes_presence_reward,
    "summary.text_bbu": text_bbu_reward,
    "summary.notes_bbu": notes_bbu_reward,
}
"""Rewards that need no data; ``summary.schema_tree`` needs a schema and is built by :func:`get_reward`."""

DETECTION_REWARDS: Mapping[str, DetectionReward] = {
    "detection.f1": f1_reward,
    "detection.maskiou": maskiou_reward,
    "detection.format": detection_format_reward,
    "detection.precision": precision_reward,
    "detection.recall": recall_reward,
    "detection.no_duplicates": no_duplicates_reward,
    "detection.count": count_reward,
    "detection.f1_iou50": f1_iou50_reward,
}
"""Detection-row rewards (``task_mode: detection``); they need a :class:`DetectionScorer` (the tokenizer)."""

REWARD_NAMES: tuple[str, ...] = (*SUMMARY_REWARDS, SCHEMA_TREE, *DETECTION_REWARDS)

_LOGGED_ONLY = {
    "summary.content_f1": 0.0,
    "summary.category_f1": 0.0,
    "summary.content_eq": 0.0,
    "summary.notes_presence": 0.0,
    "summary.text_bbu": 0.0,
    "summary.notes_bbu": 0.0,
}

_DETECTION = {
    **dict.fromkeys(DETECTION_REWARDS, 0.0),  # every detection reward is logged
    "detection.f1": 1.0,
    "detection.maskiou": 0.5,
    "detection.format": 0.25,
}
_DETECTION_COUNT = {**_DETECTION, "detection.no_duplicates": 0.5, "detection.count": 0.5}

PRESETS: Mapping[str, Mapping[str, float]] = {
    "server": {
        "summary.format": 1.0,
        "summary.header": 2.0,
        "summary.strict": 2.0,
        "summary.parse": 1.5,
        "summary.no_dup_keys": 2.0,
        "summary.dataset": 0.5,
        "summary.category_recall": 2.0,
        "summary.attr_path_recall": 2.0,
        "summary.content_structured_tversky": 3.0,
        "summary.group_stats_presence": 0.2,
        **_LOGGED_ONLY,
    },
    "attr_key": {
        "summary.format": 1.5,
        "summary.header": 2.5,
        "summary.strict": 3.5,
        "summary.parse": 2.5,
        "summary.no_dup_keys": 3.0,
        "summary.dataset": 0.5,
        "summary.category_recall": 2.0,
        "summary.attr_key_recall": 1.5,
        "summary.attr_path_recall": 1.5,
        "summary.schema_tree": 4.0,
        "summary.content_structured_tversky": 3.0,
        "summary.group_stats_presence": 0.2,
        **_LOGGED_ONLY,
    },
    "detection": _DETECTION,
    "detection_dedup": {**_DETECTION, "detection.precision": 0.5, "detection.no_duplicates": 0.5},
    "detection_count": _DETECTION_COUNT,
    "detection_iou50": {**_DETECTION_COUNT, "detection.f1": 0.0, "detection.f1_iou50": 1.0},
}
"""§5.3 weights of the summary presets (the six rewards no preset lists are included with weight 0 so they are
logged), and the detection presets: ``detection`` — F1 at the matching gate, the matches' mean maskIoU, the
format term; precision, recall, duplicates and count logged; ``detection_dedup`` — the same plus precision and
the duplicate-free rate at 0.5 each, which price every unmatched and every repeated prediction (what the
``detection`` preset let GRPO add: learner.rewards.detection); ``detection_count`` — the duplicate-free rate
and the count term at 0.5 each instead: duplicates priced, leaving out a real object priced too (the precision
term paid for it: pred ÷ GT 0.73 on the image demo); ``detection_iou50`` — ``detection_count`` with F1 at
maskIoU 0.5 in place of F1 at the gate (a loose box no longer earns the F1 term). A/B arms:
``bench/ab_learning.py --arms grpo-detection-dedup,grpo-detection-count,grpo-detection-iou50``
(bench/RESULTS.md)."""


def uses_detection(weights: Mapping[str, float]) -> bool:
    """Whether ``weights`` names a detection reward (the scorer, i.e. the tokenizer, is then needed)."""
    return any(name in DETECTION_REWARDS for name in weights)


def get_reward(name: str, schemas: SummarySchemas | None = None) -> SampleReward | DetectionReward:
    """The per-sample reward called ``name`` (a detection reward takes a ``DetectionSample``).

    Raises:
        KeyError: unknown name (the message lists the known ones).
        ValueError: ``summary.schema_tree`` without ``schemas``.
    """
    if name == SCHEMA_TREE:
        if schemas is None:
            raise ValueError(
                "summary.schema_tree needs a schema; set grpo.reward_schema_path or drop the reward from the "
                "weights"
            )
        return functools.partial(schema_tree_reward, schemas=schemas)
    if name in DETECTION_REWARDS:
        return DETECTION_REWARDS[name]
    if name not in SUMMARY_REWARDS:
        raise KeyError(f"unknown reward {name!r}; known rewards: {', '.join(REWARD_NAMES)}")
    return SUMMARY_REWARDS[name]


def total_reward(
    completions: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    weights: Mapping[str, float],
    *,
    schemas: SummarySchemas | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    detection: DetectionScorer | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """``R = Σ_k w_k · r_k`` for every completion (§3.6).

    Args:
        completions: decoded completion texts (end-of-turn markers may remain; they are removed).
        rows: one dataset row per completion: ``task_mode``, ``domain``, ``summary_ref`` (summary rows) or
            ``task_mode: detection``, ``objects`` (detection rows).
        weights: reward name → weight; every named reward is evaluated (weight 0: logged only).
        schemas: domain schemas, required when ``summary.schema_tree`` is named.
        token_ids: the sampled ids of every completion (the detection parser's input; without them the texts
            are encoded with the scorer's tokenizer).
        detection: the detection scorer, required when a ``detection.*`` reward is named and a row is a
            detection row (other rows score 0.0 on the detection rewards without it).

    Returns:
        ``(totals, per_reward)``: one total per completion, and each named reward's raw (unweighted) values
        in completion order.

    Raises:
        ValueError: ``completions``, ``rows`` (or ``token_ids``) differ in length, schema_tree lacks
            ``schemas``, or a detection reward meets a detection row without ``detection``.
        KeyError: an unknown reward name.
    """
    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completions but {len(rows)} rows; pass one row per completion")
    if token_ids is not None and len(token_ids) != len(completions):
        raise ValueError(f"{len(token_ids)} token id lists for {len(completions)} completions")
    functions = {name: get_reward(name, schemas) for name in weights}
    per_reward: dict[str, list[float]] = {}
    summary = [name for name in functions if name not in DETECTION_REWARDS]
    if summary:
        samples = [make_sample(text, make_row(row)) for text, row in zip(completions, rows, strict=True)]
        per_reward.update({name: [functions[name](s) for s in samples] for name in summary})  # type: ignore[arg-type]
    if uses_detection(weights):
        ids = token_ids if token_ids is not None else [None] * len(completions)
        found = detection_samples(completions, rows, ids, detection)
        per_reward.update(
            {name: [functions[name](s) for s in found] for name in functions if name in DETECTION_REWARDS}  # type: ignore[arg-type]
        )
    totals = [sum(weights[name] * per_reward[name][i] for name in weights) for i in range(len(completions))]
    return totals, {name: per_reward[name] for name in weights}

"""Summary rewards by name, the preset weights and the total reward (spec/GRPO_SUMMARY.md §3.6, §5.3).

Every reward is a pure ``(SummarySample) -> float``; :func:`total_reward` parses each completion once and
evaluates the rewards named in ``weights`` (weight 0 means "logged, not optimized").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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

REWARD_NAMES: tuple[str, ...] = (*SUMMARY_REWARDS, SCHEMA_TREE)

_LOGGED_ONLY = {
    "summary.content_f1": 0.0,
    "summary.category_f1": 0.0,
    "summary.content_eq": 0.0,
    "summary.notes_presence": 0.0,
    "summary.text_bbu": 0.0,
    "summary.notes_bbu": 0.0,
}

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
}
"""§5.3 weights; the six rewards no preset lists are included with weight 0 so they are logged."""


def get_reward(name: str, schemas: SummarySchemas | None = None) -> SampleReward:
    """The per-sample reward called ``name``.

    Raises:
        KeyError: unknown name (the message lists the known ones).
        ValueError: ``summary.schema_tree`` without ``schemas``.
    """
    if name == SCHEMA_TREE:
        if schemas is None:
            raise ValueError(
                "summary.schema_tree needs a schema; set grpo.reward_schema_path or drop the reward from the weights"
            )
        return functools.partial(schema_tree_reward, schemas=schemas)
    if name not in SUMMARY_REWARDS:
        raise KeyError(f"unknown reward {name!r}; known rewards: {', '.join(REWARD_NAMES)}")
    return SUMMARY_REWARDS[name]


def total_reward(
    completions: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    weights: Mapping[str, float],
    *,
    schemas: SummarySchemas | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """``R = Σ_k w_k · r_k`` for every completion (§3.6).

    Args:
        completions: decoded completion texts (end-of-turn markers may remain; they are removed).
        rows: one dataset row per completion with ``task_mode``, ``domain``, ``summary_ref``.
        weights: reward name → weight; every named reward is evaluated (weight 0: logged only).
        schemas: domain schemas, required when ``summary.schema_tree`` is named.

    Returns:
        ``(totals, per_reward)``: one total per completion, and each named reward's raw (unweighted) values
        in completion order.

    Raises:
        ValueError: ``completions`` and ``rows`` differ in length, or schema_tree lacks ``schemas``.
        KeyError: an unknown reward name.
    """
    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completions but {len(rows)} rows; pass one row per completion")
    functions = {name: get_reward(name, schemas) for name in weights}
    samples = [make_sample(text, make_row(row)) for text, row in zip(completions, rows, strict=True)]
    per_reward = {name: [fn(sample) for sample in samples] for name, fn in functions.items()}
    totals = [sum(weights[name] * per_reward[name][i] for name in weights) for i in range(len(samples))]
    return totals, per_reward

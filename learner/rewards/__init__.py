"""Rewards for GRPO (spec/GRPO_SUMMARY.md §5): the summary-task rewards, presets and the total reward."""

from learner.rewards.registry import PRESETS, REWARD_NAMES, SUMMARY_REWARDS, get_reward, total_reward
from learner.rewards.summary_parse import SummaryRow, SummarySample, make_row, make_sample
from learner.rewards.summary_schema import SummarySchemas, load_schemas

__all__ = [
    "PRESETS",
    "REWARD_NAMES",
    "SUMMARY_REWARDS",
    "SummaryRow",
    "SummarySample",
    "SummarySchemas",
    "get_reward",
    "load_schemas",
    "make_row",
    "make_sample",
    "total_reward",
]

"""Rewards for GRPO (docs/ALGORITHM.md#rewards): the summary-task rewards, the detection rewards, presets and
the total reward."""

from learner.rewards.detection import DETECTION_TASK, DetectionSample, DetectionScorer
from learner.rewards.registry import (
    DETECTION_REWARDS,
    PRESETS,
    REWARD_NAMES,
    SUMMARY_REWARDS,
    get_reward,
    total_reward,
    uses_detection,
)
from learner.rewards.summary_parse import SummaryRow, SummarySample, make_row, make_sample
from learner.rewards.summary_schema import SummarySchemas, load_schemas

__all__ = [
    "DETECTION_REWARDS",
    "DETECTION_TASK",
    "PRESETS",
    "REWARD_NAMES",
    "SUMMARY_REWARDS",
    "DetectionSample",
    "DetectionScorer",
    "SummaryRow",
    "SummarySample",
    "SummarySchemas",
    "get_reward",
    "load_schemas",
    "make_row",
    "make_sample",
    "total_reward",
    "uses_detection",
]

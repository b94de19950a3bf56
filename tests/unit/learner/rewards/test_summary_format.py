"""Format rewards (docs/ALGORITHM.md#rewards rows format…dataset, §8 reward cases)."""

from __future__ import annotations

import pytest

from learner.rewards.summary_format import (
    dataset_reward,
    format_reward,
    header_reward,
    no_dup_keys_reward,
    parse_reward,
    strict_reward,
)
from tests.unit.learner.rewards.summary_examples import (
    BBU_HEADER,
    WORKED_COMPLETION,
    WORKED_PRED_LINE,
    WORKED_REF,
    sample,
)

FORMAT_FAMILY = (
    format_reward,
    header_reward,
    strict_reward,
    parse_reward,
    no_dup_keys_reward,
    dataset_reward,
)


def _scores(completion: str, ref: object = WORKED_REF, domain: str = "BBU") -> tuple[float, ...]:
    s = sample(completion, ref, domain)
    return tuple(fn(s) for fn in FORMAT_FAMILY)


def test_worked_example_format_values_spec_5_4() -> None:
    # format 1, header 1, strict 0, parse 0, no_dup_keys 0, dataset 1
    assert _scores(WORKED_COMPLETION) == (1.0, 1.0, 0.0, 0.0, 0.0, 1.0)


def test_irrelevant_row_answering_irrelevant_spec_8() -> None:
    s = sample("无关图片<|im_end|>", ref="无关图片")
    assert format_reward(s) == 1.0
    assert header_reward(s) == 0.0
    assert (strict_reward(s), parse_reward(s), no_dup_keys_reward(s), dataset_reward(s)) == (
        0.0,
        0.0,
        0.0,
        0.0,
    )


@pytest.mark.parametrize(
    "completion",
    [
        f"{BBU_HEADER}\n{WORKED_PRED_LINE}",
        "无关图片\n<DOMAIN=RRU>, <TASK=SUMMARY>",
        "无关图片 <TASK=SUMMARY>",
    ],
)
def test_irrelevant_row_that_emits_a_header_spec_8(completion: str) -> None:
    s = sample(completion, ref="无关图片")
    assert header_reward(s) == -1.0
    assert format_reward(s) == 0.0


def test_relevant_row_answering_irrelevant_spec_8() -> None:
    s = sample("无关图片", ref=WORKED_REF)
    assert strict_reward(s) == -1.0
    assert parse_reward(s) == -1.0
    assert format_reward(s) == 0.0
    assert header_reward(s) == 0.0
    assert dataset_reward(s) == 0.0


def test_duplicate_keys_spec_8() -> None:
    s = sample(f'{BBU_HEADER}\n{{"统计": [], "统计": []}}')
    assert no_dup_keys_reward(s) == -1.0
    assert parse_reward(s) == 0.0  # still a JSON object
    nested = sample(f'{BBU_HEADER}\n{{"统计": [{{"类别": "A", "位置": {{"左侧": 1, "左侧": 1}}}}]}}')
    assert no_dup_keys_reward(nested) == -1.0


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        # three lines: format 0, strict -1 (header and dataset still judged on line 1)
        (f"{BBU_HEADER}\n{WORKED_PRED_LINE}\nextra", (0.0, 1.0, -1.0, 0.0, 0.0, 1.0)),
        # wrong domain in the header: regex matches (format 1) but not the expected header
        (f"<DOMAIN=RRU>, <TASK=SUMMARY>\n{WORKED_PRED_LINE}", (1.0, 0.0, -1.0, 0.0, 0.0, 0.0)),
        # right domain, wrong task: dataset only checks the DOMAIN prefix
        (f"<DOMAIN=BBU>, <TASK=DENSE>\n{WORKED_PRED_LINE}", (1.0, 0.0, -1.0, 0.0, 0.0, 1.0)),
        # line 2 truncated: not an object, does not end with }
        (f"{BBU_HEADER}\n{WORKED_PRED_LINE[:-5]}", (0.0, 1.0, 0.0, -1.0, 0.0, 1.0)),
        # line 2 a JSON array
        (f"{BBU_HEADER}\n[1, 2]", (0.0, 1.0, 0.0, -1.0, 0.0, 1.0)),
        # header only
        (BBU_HEADER, (0.0, 1.0, -1.0, -1.0, 0.0, 1.0)),
        # header line with trailing text fails the anchored regex
        (f"{BBU_HEADER} ok\n{WORKED_PRED_LINE}", (0.0, 0.0, -1.0, 0.0, 0.0, 1.0)),
    ],
    ids=["three-lines", "wrong-domain", "wrong-task", "truncated", "array", "header-only", "header-suffix"],
)
def test_malformed_relevant_answers(completion: str, expected: tuple[float, ...]) -> None:
    assert _scores(completion) == expected


def test_format_allows_whitespace_around_json_line() -> None:
    assert format_reward(sample(f"{BBU_HEADER}\n  {WORKED_PRED_LINE}  ")) == 1.0


@pytest.mark.parametrize("fn", FORMAT_FAMILY, ids=lambda fn: fn.__name__)
def test_non_summary_row_scores_zero(fn) -> None:
    assert fn(sample("无关图片", ref="无关图片", task_mode="dense")) == 0.0
    assert fn(sample(f"{BBU_HEADER}\n{{}}", task_mode="dense")) == 0.0

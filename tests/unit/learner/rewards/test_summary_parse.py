"""Shared parsing rules of docs/ALGORITHM.md#summary-parsing."""

from __future__ import annotations

import pytest

from learner.rewards.summary_parse import (
    categories,
    category_entries,
    clean_text,
    expected_header,
    make_row,
    parse_json_line,
)
from tests.unit.learner.rewards.summary_examples import WORKED_COMPLETION, WORKED_REF, sample


def test_clean_text_removes_end_of_turn_then_strips() -> None:
    assert clean_text("  无关图片<|im_end|>\n") == "无关图片"
    assert clean_text("a\nb<|endoftext|>") == "a\nb"


def test_header_regex_and_expected_header() -> None:
    s = sample(WORKED_COMPLETION)
    assert s.lines[0] == expected_header("BBU") == "<DOMAIN=BBU>, <TASK=SUMMARY>"
    assert s.pred is not None and len(s.lines) == 2


@pytest.mark.parametrize(
    ("line", "has_dup"),
    [
        ('{"统计": [], "统计": []}', True),
        ('{"统计": [{"类别": "A", "位置": {"左": 1, "左": 2}}]}', True),  # nested depth
        ('{"a": [{"b": 1}, {"b": 2}]}', False),  # same key in sibling objects is not a duplicate
    ],
)
def test_duplicate_keys_at_every_depth(line: str, has_dup: bool) -> None:
    parsed = parse_json_line(line)
    assert parsed.ok
    assert parsed.duplicate_keys is has_dup


@pytest.mark.parametrize("line", ['{"a": 1', "not json", ""])
def test_invalid_json_is_not_ok(line: str) -> None:
    assert parse_json_line(line).ok is False


@pytest.mark.parametrize(
    "completion",
    [
        "<DOMAIN=BBU>, <TASK=SUMMARY>",
        "<DOMAIN=BBU>, <TASK=SUMMARY>\n[1, 2]",
        "<DOMAIN=BBU>, <TASK=SUMMARY>\n{bad",
    ],
)
def test_pred_is_none_unless_line_two_is_an_object(completion: str) -> None:
    assert sample(completion).pred is None


def test_categories_merge_entries_and_skip_invalid_ones() -> None:
    obj = {
        "统计": [
            {"类别": " A ", "可见性": {"完整": 1}, "文本": ["x"]},
            {"类别": "A", "可见性": {"完整": 2, "部分": 1}, "捆扎": {"整齐": 1}, "文本": ["y"]},
            {"类别": 3, "位置": {"左": 1}},
            "not an object",
        ]
    }
    merged = categories(obj)
    assert list(merged) == ["A"]
    assert merged["A"] == {"可见性": {"完整": 3, "部分": 1}, "文本": ["x", "y"], "捆扎": {"整齐": 1}}
    assert [name for name, _ in category_entries(obj)] == ["A", "A"]


def test_categories_of_non_list_stats_is_empty() -> None:
    assert categories({"统计": {"类别": "A"}}) == {}
    assert categories({}) == {}


def test_make_row_reads_serialized_and_irrelevant_refs() -> None:
    import json

    assert (
        make_row({"task_mode": "summary", "domain": "BBU", "summary_ref": json.dumps(WORKED_REF)}).ref
        == WORKED_REF
    )
    irrelevant = make_row({"task_mode": "summary", "domain": "BBU", "summary_ref": "无关图片"})
    assert irrelevant.ref_kind == "irrelevant" and irrelevant.ref is None
    assert make_row({"task_mode": "summary", "domain": "BBU", "summary_ref": 5}).ref_kind == "invalid"
    with pytest.raises(KeyError, match="task_mode"):
        make_row({"domain": "BBU"})

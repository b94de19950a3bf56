"""Presence and free-text rewards (docs/ALGORITHM.md#rewards: group_stats_presence, notes_presence, text_bbu,
notes_bbu)."""

from __future__ import annotations

import pytest

from learner.rewards.summary_text import (
    group_stats_presence_reward,
    normalize,
    note_clauses,
    notes_bbu_reward,
    notes_presence_reward,
    ocr_strings,
    text_bbu_reward,
)
from tests.unit.learner.rewards.summary_examples import RRU_HEADER, WORKED_COMPLETION, answer, sample

TEXT_REWARDS = (group_stats_presence_reward, notes_presence_reward, text_bbu_reward, notes_bbu_reward)


def test_worked_example_presence_spec_5_4() -> None:
    s = sample(WORKED_COMPLETION)
    assert group_stats_presence_reward(s) == 1.0  # neither has 分组统计
    assert notes_presence_reward(s) == 0.0  # ref has 备注, pred not
    assert text_bbu_reward(s) == 0.0  # ref NR-01, nothing predicted
    assert notes_bbu_reward(s) == 0.0


@pytest.mark.parametrize(
    ("pred_value", "ref_value", "expected"),
    [
        ({"a": 1}, {"b": 2}, 1.0),
        (None, {"b": 2}, 0.0),
        ({}, None, 1.0),
        ({}, {"b": 2}, 0.0),
        ("  ", None, 1.0),
    ],
)
def test_group_stats_presence(pred_value: object, ref_value: object, expected: float) -> None:
    pred = {"统计": []} | ({} if pred_value is None else {"分组统计": pred_value})
    ref = {"统计": []} | ({} if ref_value is None else {"分组统计": ref_value})
    assert group_stats_presence_reward(sample(answer(pred, RRU_HEADER), ref, "RRU")) == expected


def test_normalize_nfkc_and_whitespace() -> None:
    assert normalize(" ＮＲ－０１ \t\n") == "NR-01"


def test_ocr_strings_shapes() -> None:
    obj = {
        "统计": [
            {"类别": "A", "文本": "x"},
            {"类别": "B", "文本": ["y", 3, "y"]},
            {"类别": "C", "文本": {"z": 2}},
        ]
    }
    assert ocr_strings(obj) == {"x": 1, "y": 2, "z": 2}


def test_text_bbu_recall_minus_half_overflow() -> None:
    ref = {"统计": [{"类别": "B", "文本": ["NR-01", "NR-02"]}, {"类别": "C", "文本": {"AB": 2}}]}
    pred = {
        "统计": [{"类别": "B", "文本": ["NR-01", " ＮＲ－01"]}, {"类别": "C", "文本": {"AB": 1, "ZZ": 3}}]
    }
    # #ref 4, #pred 6, overlap NR-01 1 + AB 1 → recall 0.5, overflow 0.5 → 0.25
    assert text_bbu_reward(sample(answer(pred), ref)) == pytest.approx(0.25)


def test_text_bbu_clips_and_empty_reference() -> None:
    ref = {"统计": [{"类别": "B", "文本": ["a"]}]}
    flood = {"统计": [{"类别": "B", "文本": [f"w{i}" for i in range(10)]}]}
    assert text_bbu_reward(sample(answer(flood), ref)) == -1.0
    empty = {"统计": [{"类别": "B"}]}
    assert text_bbu_reward(sample(answer(empty), empty)) == 1.0
    assert text_bbu_reward(sample(answer(ref), empty)) == 0.0
    assert text_bbu_reward(sample(answer(ref), ref)) == 1.0


def test_note_clauses_split_and_normalize() -> None:
    obj = {"备注": ["电源线松动，标签 缺失;需复查。", "", "a,b\nc；d"]}
    assert note_clauses(obj) == {"电源线松动", "标签缺失", "需复查", "a", "b", "c", "d"}


def test_notes_bbu_set_recall() -> None:
    ref = {"统计": [], "备注": "电源线松动，标签 缺失;需复查。"}
    pred = {"统计": [], "备注": ["标签缺失", "其他"]}
    assert notes_bbu_reward(sample(answer(pred), ref)) == pytest.approx(1 / 3)
    none = {"统计": []}
    assert notes_bbu_reward(sample(answer(none), none)) == 1.0
    assert notes_bbu_reward(sample(answer(pred), none)) == 0.0


def test_bbu_only_rewards_score_zero_on_rru() -> None:
    ref = {"统计": [{"类别": "B", "文本": ["a"]}], "备注": "x"}
    rru = sample(answer(ref, RRU_HEADER), ref, "RRU")
    assert text_bbu_reward(rru) == 0.0
    assert notes_bbu_reward(rru) == 0.0
    assert notes_presence_reward(rru) == 1.0  # presence is not BBU-only


@pytest.mark.parametrize("fn", TEXT_REWARDS, ids=lambda fn: fn.__name__)
def test_irrelevant_unparseable_and_non_summary_score_zero(fn) -> None:
    assert fn(sample("无关图片", ref="无关图片")) == 0.0
    assert fn(sample("<DOMAIN=BBU>, <TASK=SUMMARY>\n{")) == 0.0
    assert fn(sample(answer({"统计": []}), {"统计": []}, task_mode="dense")) == 0.0

"""Facts, Tversky, content_f1 and content_eq (docs/ALGORITHM.md#facts-and-tversky, §5.4)."""

from __future__ import annotations

from collections import Counter

import pytest

from learner.rewards.summary_facts import (
    canonical,
    content_eq_reward,
    content_f1_reward,
    content_structured_tversky_reward,
    facts,
    overlap_counts,
)
from tests.unit.learner.rewards.summary_examples import (
    RRU_HEADER,
    WORKED_COMPLETION,
    WORKED_PRED_LINE,
    WORKED_REF,
    answer,
    sample,
)


def test_worked_example_fact_counts_spec_5_4() -> None:
    pred = sample(WORKED_COMPLETION).pred
    assert overlap_counts(facts(pred, "BBU"), facts(WORKED_REF, "BBU")) == (3, 2, 4)
    assert overlap_counts(facts(pred, "RRU"), facts(WORKED_REF, "RRU")) == (3, 2, 5)  # 文本 counted for RRU


def test_worked_example_tversky_spec_5_4() -> None:
    assert content_structured_tversky_reward(sample(WORKED_COMPLETION)) == pytest.approx(3 / 7.6)
    assert content_structured_tversky_reward(sample(WORKED_COMPLETION)) == pytest.approx(0.3947, abs=1e-4)
    rru = sample(f"{RRU_HEADER}\n{WORKED_PRED_LINE}", domain="RRU")
    assert content_structured_tversky_reward(rru) == pytest.approx(0.3261, abs=1e-4)


def test_worked_example_content_f1() -> None:
    assert content_f1_reward(sample(WORKED_COMPLETION)) == pytest.approx(6 / 12)  # 2·3 / (6 + 2 + 4)


def test_walk_rules() -> None:
    obj = {
        "统计": [
            {
                "类别": "A",
                "可见性": {"完整": 2, "缺失": 0, "flag": True, "备注": "x"},
                "子项": {"外层": {"内层": 3}},
                "列表": ["p", {"q": 1}, 5],
                "数量": 4,
            },
            {"类别": "A", "可见性": {"完整": 1}},
        ],
        "备注": "never a fact",
    }
    assert facts(obj, "BBU") == Counter(
        {
            ("A", "可见性", "完整"): 3,  # counts of equal facts add up across entries
            ("A", "可见性/flag", "True"): 1,  # bool is not a count
            ("A", "可见性/备注", "x"): 1,
            ("A", "子项/外层", "内层"): 3,
            ("A", "列表", "p"): 1,
            ("A", "列表", "q"): 1,
            ("A", "列表", "5"): 1,
            ("A", "数量", "4"): 1,
        }
    )


def test_text_is_a_fact_only_outside_bbu() -> None:
    obj = {"统计": [{"类别": "B", "文本": ["NR-01"]}]}
    assert facts(obj, "BBU") == Counter()
    assert facts(obj, "RRU") == Counter({("B", "文本", "NR-01"): 1})


def test_both_empty_is_one_and_exact_is_one() -> None:
    empty = {"统计": []}
    assert content_structured_tversky_reward(sample(answer(empty), empty)) == 1.0
    assert content_f1_reward(sample(answer(empty), empty)) == 1.0
    assert content_structured_tversky_reward(sample(answer(WORKED_REF))) == 1.0


def test_content_eq_ignores_key_and_entry_order() -> None:
    shuffled = {"备注": ["n1"], "统计": list(reversed(WORKED_REF["统计"]))}
    assert canonical(shuffled) == canonical(WORKED_REF)
    assert content_eq_reward(sample(answer(shuffled))) == 1.0
    assert content_eq_reward(sample(WORKED_COMPLETION)) == 0.0


@pytest.mark.parametrize(
    "fn", [content_structured_tversky_reward, content_f1_reward, content_eq_reward], ids=lambda f: f.__name__
)
def test_irrelevant_unparseable_and_non_summary_score_zero(fn) -> None:
    assert fn(sample("无关图片", ref="无关图片")) == 0.0
    assert fn(sample("<DOMAIN=BBU>, <TASK=SUMMARY>")) == 0.0
    assert fn(sample(answer(WORKED_REF), task_mode="dense")) == 0.0

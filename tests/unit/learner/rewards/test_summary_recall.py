"""Category/attribute recall rewards (docs/ALGORITHM.md#rewards, §5.4)."""

from __future__ import annotations

import pytest

from learner.rewards.summary_recall import (
    attr_key_recall_reward,
    attr_path_recall_reward,
    attr_paths,
    category_f1_reward,
    category_recall_reward,
)
from tests.unit.learner.rewards.summary_examples import WORKED_COMPLETION, answer, sample

RECALLS = (category_recall_reward, attr_key_recall_reward, attr_path_recall_reward, category_f1_reward)


def _stats(*entries: dict) -> dict:
    return {"统计": list(entries)}


def test_worked_example_values_spec_5_4() -> None:
    s = sample(WORKED_COMPLETION)
    assert category_recall_reward(s) == pytest.approx(0.5)
    assert attr_key_recall_reward(s) == pytest.approx(1 / 3, abs=1e-4)  # A: 2/3, B: 0/1
    assert attr_path_recall_reward(s) == pytest.approx(2 / 3, abs=1e-4)  # A: 可见性/完整, 捆扎/整齐 of 3
    assert category_f1_reward(s) == pytest.approx(0.5)


def test_attr_key_recall_weighs_categories_equally() -> None:
    ref = _stats(
        {"类别": "A", "k1": {"x": 1}, "k2": {"x": 1}, "k3": {"x": 1}, "k4": {"x": 1}}, {"类别": "B", "k": 1}
    )
    pred = _stats({"类别": "A", "k1": {"x": 1}}, {"类别": "B", "k": 1})
    # per-category mean (1/4 + 1) / 2, not pooled 2/5
    assert attr_key_recall_reward(sample(answer(pred), ref)) == pytest.approx(0.625)


def test_attr_key_recall_edge_cases() -> None:
    empty = _stats()
    assert attr_key_recall_reward(sample(answer(empty), empty)) == 1.0
    assert attr_key_recall_reward(sample(answer(_stats({"类别": "A"})), empty)) == 0.0
    only_text = _stats({"类别": "A", "文本": ["x"]})
    assert attr_key_recall_reward(sample(answer(_stats()), only_text)) == 1.0  # no keys after dropping 文本


def test_category_recall_edge_cases() -> None:
    empty = _stats()
    assert category_recall_reward(sample(answer(empty), empty)) == 1.0
    assert category_recall_reward(sample(answer(_stats({"类别": "A"})), empty)) == 0.0
    ref = _stats({"类别": "A"}, {"类别": "B"}, {"类别": "C"})
    assert category_recall_reward(sample(answer(_stats({"类别": "B"}, {"类别": "Z"})), ref)) == pytest.approx(
        1 / 3
    )


def test_category_f1_edge_cases() -> None:
    empty = _stats()
    assert category_f1_reward(sample(answer(empty), empty)) == 1.0
    assert category_f1_reward(sample(answer(_stats({"类别": "A"})), empty)) == 0.0
    assert category_f1_reward(sample(answer(empty), _stats({"类别": "A"}))) == 0.0


def test_attr_paths_filters_children() -> None:
    attrs = {
        "捆扎": {"整齐": 1, "123": 1, "a=b": 1, "x" * 33: 1, "x" * 32: 1},
        "品牌": {"y": 1},  # not a path parent
        "位置": "左侧",  # value not an object
    }
    assert attr_paths(attrs) == {"捆扎/整齐", f"捆扎/{'x' * 32}"}


def test_attr_path_recall_without_common_categories() -> None:
    ref_with_paths = _stats({"类别": "A", "位置": {"左侧": 1}})
    assert (
        attr_path_recall_reward(sample(answer(_stats({"类别": "B", "位置": {"左侧": 1}})), ref_with_paths))
        == 0.0
    )
    ref_without_paths = _stats({"类别": "A", "品牌": {"x": 1}})
    assert attr_path_recall_reward(sample(answer(_stats()), ref_without_paths)) == 1.0


def test_attr_path_recall_partial() -> None:
    ref = _stats({"类别": "A", "位置": {"左侧": 1, "右侧": 1}}, {"类别": "B", "方向": {"上": 1}})
    pred = _stats({"类别": "A", "位置": {"左侧": 3}}, {"类别": "B", "方向": {"上": 1, "下": 1}})
    assert attr_path_recall_reward(sample(answer(pred), ref)) == pytest.approx((0.5 + 1.0) / 2)


@pytest.mark.parametrize("fn", RECALLS, ids=lambda fn: fn.__name__)
def test_irrelevant_unparseable_and_non_summary_score_zero(fn) -> None:
    assert fn(sample("无关图片", ref="无关图片")) == 0.0
    assert fn(sample("<DOMAIN=BBU>, <TASK=SUMMARY>\n{broken")) == 0.0
    assert fn(sample(WORKED_COMPLETION, task_mode="dense")) == 0.0

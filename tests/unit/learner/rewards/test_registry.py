"""Reward registry, presets and total reward (docs/ALGORITHM.md#total-reward, §5.3, §5.4, §8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.rewards import DETECTION_REWARDS
from learner.rewards.registry import PRESETS, REWARD_NAMES, SUMMARY_REWARDS, get_reward, total_reward
from learner.rewards.summary_schema import load_schemas
from tests.unit.learner.rewards.summary_examples import (
    BBU_HEADER,
    RRU_HEADER,
    WORKED_COMPLETION,
    WORKED_PRED_LINE,
    WORKED_REF,
    row,
)

SCHEMAS = load_schemas(Path(__file__).resolve().parents[4] / "learner/rewards/schemas/worked_example.json")

WORKED_VALUES = {
    "summary.format": 1.0,
    "summary.header": 1.0,
    "summary.strict": 0.0,
    "summary.parse": 0.0,
    "summary.no_dup_keys": 0.0,
    "summary.dataset": 1.0,
    "summary.category_recall": 0.5,
    "summary.attr_key_recall": 0.3333,
    "summary.attr_path_recall": 0.6667,
    "summary.content_structured_tversky": 0.3947,
    "summary.group_stats_presence": 1.0,
    "summary.notes_presence": 0.0,
    "summary.schema_tree": 0.5083,
}


@pytest.mark.parametrize(("name", "expected"), list(WORKED_VALUES.items()), ids=lambda v: f"spec5.4-{v}")
def test_worked_example_every_value_spec_5_4(name: str, expected: float) -> None:
    _, per_reward = total_reward([WORKED_COMPLETION], [row(WORKED_REF)], {name: 1.0}, schemas=SCHEMAS)
    assert per_reward[name][0] == pytest.approx(expected, abs=1e-4)


def test_worked_example_rru_tversky_variant_spec_5_4() -> None:
    rru = f"{RRU_HEADER}\n{WORKED_PRED_LINE}"
    _, per_reward = total_reward(
        [rru], [row(json.dumps(WORKED_REF), "RRU")], {"summary.content_structured_tversky": 1}
    )
    assert per_reward["summary.content_structured_tversky"][0] == pytest.approx(0.3261, abs=1e-4)


def test_presets_match_spec_5_3() -> None:
    server, attr_key = PRESETS["server"], PRESETS["attr_key"]
    assert sum(server.values()) == pytest.approx(16.2)
    assert sum(attr_key.values()) == pytest.approx(25.7)
    assert "summary.schema_tree" not in server and "summary.attr_key_recall" not in server
    assert attr_key["summary.schema_tree"] == 4.0 and attr_key["summary.strict"] == 3.5
    logged_only = {"content_f1", "category_f1", "content_eq", "notes_presence", "text_bbu", "notes_bbu"}
    for preset in (server, attr_key):
        assert {n.removeprefix("summary.") for n, w in preset.items() if w == 0.0} == logged_only
        assert set(preset) <= set(REWARD_NAMES)


def test_total_is_weighted_sum_for_the_server_preset() -> None:
    totals, per_reward = total_reward([WORKED_COMPLETION], [row(WORKED_REF)], PRESETS["server"])
    # 1 + 2·1 + 0.5·1 + 2·0.5 + 2·(2/3) + 3·(3/7.6) + 0.2·1
    expected = 1 + 2 + 0.5 + 1 + 4 / 3 + 9 / 7.6 + 0.2
    assert totals[0] == pytest.approx(expected)
    assert set(per_reward) == set(PRESETS["server"])


def test_total_attr_key_preset_needs_schema() -> None:
    with pytest.raises(ValueError, match="reward_schema_path"):
        total_reward([WORKED_COMPLETION], [row(WORKED_REF)], PRESETS["attr_key"])
    totals, _ = total_reward([WORKED_COMPLETION], [row(WORKED_REF)], PRESETS["attr_key"], schemas=SCHEMAS)
    expected = (
        1.5 + 2.5 + 0.5 + 2 * 0.5 + 1.5 / 3 + 1.5 * 2 / 3 + 4 * (0.75 - 0.35 / 3 - 0.125) + 9 / 7.6 + 0.2
    )
    assert totals[0] == pytest.approx(expected)


def test_batch_of_mixed_rows() -> None:
    completions = [WORKED_COMPLETION, "无关图片", "无关图片", f"{BBU_HEADER}\n{{}}"]
    rows = [row(WORKED_REF), row("无关图片"), row(WORKED_REF), row(WORKED_REF, task_mode="dense")]
    totals, per_reward = total_reward(completions, rows, {"summary.format": 1.0, "summary.strict": 2.0})
    assert per_reward["summary.format"] == [1.0, 1.0, 0.0, 0.0]
    assert per_reward["summary.strict"] == [0.0, 0.0, -1.0, 0.0]
    assert totals == [1.0, 1.0, -2.0, 0.0]


@pytest.mark.parametrize("name", REWARD_NAMES)
@pytest.mark.parametrize(
    "completion", [WORKED_COMPLETION, "无关图片", f'{BBU_HEADER}\n{{"统计": [], "统计": []}}', ""]
)
def test_non_summary_rows_score_zero_spec_8(name: str, completion: str) -> None:
    for ref in (WORKED_REF, "无关图片"):
        _, per_reward = total_reward(
            [completion], [row(ref, task_mode="dense")], {name: 1.0}, schemas=SCHEMAS
        )
        assert per_reward[name] == [0.0]


def test_unknown_name_and_length_mismatch() -> None:
    with pytest.raises(KeyError, match="summary.nope"):
        get_reward("summary.nope")
    with pytest.raises(ValueError, match="2 completions but 1 rows"):
        total_reward(["a", "b"], [row(WORKED_REF)], {"summary.format": 1.0})
    assert set(SUMMARY_REWARDS) | {"summary.schema_tree"} | set(DETECTION_REWARDS) == set(REWARD_NAMES)

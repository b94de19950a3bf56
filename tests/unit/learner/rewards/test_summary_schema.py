"""summary.schema_tree and its data file (docs/ALGORITHM.md#schema-tree, §5.4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.rewards.summary_schema import (
    DomainSchema,
    SummarySchemas,
    has_bad_station_distance,
    load_schemas,
    schema_tree_reward,
    schema_tree_score,
)
from tests.unit.learner.rewards.summary_examples import RRU_HEADER, WORKED_COMPLETION, answer, sample

SCHEMA_FILE = Path(__file__).resolve().parents[4] / "learner" / "rewards" / "schemas" / "worked_example.json"


@pytest.fixture(scope="module")
def schemas() -> SummarySchemas:
    return load_schemas(SCHEMA_FILE)


def test_worked_example_schema_tree_spec_5_4(schemas: SummarySchemas) -> None:
    # completeness 3/4, extra_key_frac 1/3, halluc_frac 1/2, extra_top_frac 0
    expected = 0.75 - 0.35 / 3 - 0.25 / 2
    assert schema_tree_reward(sample(WORKED_COMPLETION), schemas) == pytest.approx(expected)
    assert schema_tree_reward(sample(WORKED_COMPLETION), schemas) == pytest.approx(0.5083, abs=1e-4)


def test_perfect_prediction_scores_one(schemas: SummarySchemas) -> None:
    ref = {
        "统计": [
            {"类别": "A", "可见性": {"完整": 1}, "保护措施": {"有": 1}},
            {"类别": "B", "位置": {"左": 1}},
        ]
    }
    assert schema_tree_reward(sample(answer(ref), ref), schemas) == 1.0


def test_extra_top_level_key_and_clip() -> None:
    schema = DomainSchema(top_level_allowed=("统计",), top_level_required=("统计",))
    ref = {"统计": [{"类别": "A"}]}
    pred = {"统计": [{"类别": "Z", "k": 1}], "多余": 1}
    # completeness 1 (统计 present; A unknown to the schema) − 0.35·1 − 0.25·1 − 0.30·1/2
    assert schema_tree_score(pred, ref, schema, "BBU") == pytest.approx(1 - 0.35 - 0.25 - 0.15)
    assert schema_tree_score({"x": 1}, ref, schema, "RRU") == pytest.approx(0.0 - 0.30)
    strict = DomainSchema(top_level_allowed=("统计",), top_level_required=("y",))
    worst = {"统计": [{"类别": "Z", "k": 1}], "x": {"站点距离": "far"}}
    # 0 − 0.35 − 0.25 − 0.15 − 0.60 = −1.35, clipped
    assert schema_tree_score(worst, ref, strict, "RRU") == -1.0


@pytest.mark.parametrize(
    ("value", "bad"),
    [
        ({"站点距离": {"12": 1}}, False),
        ({"站点距离": 35}, False),
        ({"站点距离": "35"}, False),
        ({"统计": [{"类别": "A", "x": {"站点距离": {"12m": 1}}}]}, True),  # any depth, key not digits-only
        ({"站点距离": "35米"}, True),
        ({"站点距离": 3.5}, True),
        ({"站点距离": True}, True),
    ],
)
def test_station_distance_rule(value: dict, bad: bool) -> None:
    assert has_bad_station_distance(value) is bad


def test_station_distance_penalty_is_rru_only() -> None:
    schema = DomainSchema(top_level_allowed=("统计", "分组统计"))
    ref = {"统计": []}
    pred = {"统计": [], "分组统计": {"站点距离": "far"}}
    assert schema_tree_score(pred, ref, schema, "BBU") == 1.0
    assert schema_tree_score(pred, ref, schema, "RRU") == pytest.approx(0.4)


def test_missing_domain_and_non_summary_score_zero(schemas: SummarySchemas) -> None:
    rru = sample(f"{RRU_HEADER}\n{{}}", domain="RRU")
    assert schema_tree_reward(rru, schemas) == 0.0
    assert schema_tree_reward(sample(WORKED_COMPLETION, task_mode="dense"), schemas) == 0.0
    assert schema_tree_reward(sample("无关图片", ref="无关图片"), schemas) == 0.0


def test_load_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"BBU": {"top_level_allowed": [], "categories": {"A": {"required": ["k"]}}}}))
    with pytest.raises(ValueError, match=r"BBU\.categories\.A.*not in 'allowed'"):
        load_schemas(bad)
    bad.write_text(json.dumps({"BBU": {"top_level_allowed": [], "extra": 1}}))
    with pytest.raises(ValueError, match="extra"):
        load_schemas(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_schemas(tmp_path / "missing.json")

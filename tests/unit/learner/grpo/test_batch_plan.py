"""batch_plan shorthand (docs/ALGORITHM.md#batch-plan)."""

from __future__ import annotations

import pytest

from learner.grpo.config.batch_plan import BatchPlan, apply_batch_plan, parse_gpu_list
from learner.yaml_loader import ConfigError


@pytest.mark.parametrize(
    ("value", "expected"), [("0,1, 2", (0, 1, 2)), (3, (3,)), ("", ()), ([4, 5], [4, 5])]
)
def test_parse_gpu_list(value: object, expected: object) -> None:
    assert parse_gpu_list(value) == expected


def test_default_preset_plan_fills_every_field() -> None:
    raw = {"training": {"seed": 1}}
    plan = BatchPlan(
        effective_batch_size=32,
        per_device_batch_size=4,
        server_gpus="0,1,2,3,4,5",
        train_gpus=[6, 7],
        server_tp=1,
        server_dp=6,
    )
    out = apply_batch_plan(raw, plan)
    assert raw == {"training": {"seed": 1}}  # not modified
    assert out["training"] == {"seed": 1, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}
    assert out["grpo"] == {"generation_batch_size": 32, "steps_per_generation": 1}
    assert out["server"] == {
        "gpus": [0, 1, 2, 3, 4, 5],
        "vllm": {"tensor_parallel_size": 1, "data_parallel_size": 6},
    }
    assert out["train_gpus"] == [6, 7]


def test_plan_uses_training_per_device_when_absent() -> None:
    out = apply_batch_plan(
        {"training": {"per_device_train_batch_size": 2}, "train_gpus": "6,7"},
        BatchPlan(effective_batch_size=8),
    )
    assert out["training"]["gradient_accumulation_steps"] == 2


def test_non_integer_gas_is_rejected() -> None:
    with pytest.raises(
        ConfigError, match=r"batch_plan\.effective_batch_size: 30 .* per_device_batch_size 4 × 2"
    ):
        apply_batch_plan({}, BatchPlan(effective_batch_size=30, per_device_batch_size=4, train_gpus=[6, 7]))


def test_empty_plan_changes_nothing() -> None:
    raw = {"server": {"gpus": [0]}}
    assert apply_batch_plan(raw, BatchPlan()) == raw

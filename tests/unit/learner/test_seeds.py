"""Per-request seeds (docs/ALGORITHM.md#seeds; required tests §20.4)."""

from __future__ import annotations

import pytest

from learner.config import RunConfig, check_runtime_guards
from learner.rollout.seeds import MICRO_STRIDE, STEP_STRIDE, request_index, request_seed
from learner.training_config import MAX_GAS, MAX_REQUESTS_PER_MICRO_STEP
from learner.yaml_loader import ConfigError


@pytest.mark.parametrize(
    ("micro", "req", "seed"), [(0, 0, 10000047), (0, 2, 10000049), (0, 4, 10000051), (1, 2, 10010056)]
)
def test_5_3_examples(micro, req, seed):
    assert request_seed(17, 10, micro, req) == seed


def test_seed_is_31_bit():
    s = request_seed(2**31 - 1, 10**6, 98, 10_006)
    assert 0 <= s <= 0x7FFFFFFF
    assert s == (2**31 - 1 + 10**6 * 1_000_003 + 98 * 10_007 + 10_006) & 0x7FFFFFFF


def test_request_index():
    assert request_index(dp_rank=1, per_device_batch_size=4, i=2) == 6
    with pytest.raises(ValueError):
        request_index(0, 4, 4)


def test_no_collision_within_an_optimizer_step_at_the_limits():
    assert (MAX_GAS, MAX_REQUESTS_PER_MICRO_STEP) == (99, 10_007) and MAX_GAS * MICRO_STRIDE < STEP_STRIDE
    seeds = {request_seed(5, 3, m, r) for m in range(99) for r in range(0, 10_007, 7)}
    assert len(seeds) == 99 * len(range(0, 10_007, 7))


def test_layout_guard_names_the_key_and_the_fix():
    """The requests of one micro-step over every rank must fit the micro-step stride (the start-up guard;
    the accumulation limit is `training.gradient_accumulation_steps`' own check, test_training_config)."""
    cfg = RunConfig.model_validate(
        {
            "model": {"path": "m"},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
            "training": {"per_device_train_batch_size": 5004, "gradient_accumulation_steps": MAX_GAS},
        }
    )
    check_runtime_guards(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"5004 × world size 2 > 10007 .*lower training.per_device_train"):
        check_runtime_guards(cfg, world_size=2)

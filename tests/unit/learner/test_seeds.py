"""Per-request seeds (docs/ALGORITHM.md#seeds; required tests §20.4)."""

from __future__ import annotations

import pytest

from learner.rollout.seeds import check_seed_layout, request_index, request_seed


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
    seeds = {request_seed(5, 3, m, r) for m in range(99) for r in range(0, 10_007, 7)}
    assert len(seeds) == 99 * len(range(0, 10_007, 7))


def test_layout_guard():
    check_seed_layout(dp_world_size=8, per_device_batch_size=16, gas=99)
    with pytest.raises(ValueError, match="gradient_accumulation_steps 100"):
        check_seed_layout(dp_world_size=1, per_device_batch_size=1, gas=100)
    with pytest.raises(ValueError, match="10008"):
        check_seed_layout(dp_world_size=2, per_device_batch_size=5004, gas=1)
    with pytest.raises(ValueError):
        check_seed_layout(dp_world_size=0, per_device_batch_size=1, gas=1)

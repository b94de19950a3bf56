"""Dynamic sampling (docs/ALGORITHM.md#dynamic-sampling; the example is a required test of §8)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from learner.grpo.dynamic_sampling import dynamic_sample, is_zero_variance


@dataclass(frozen=True)
class Group:
    name: str
    rewards: tuple[float, ...]


def _resampler(rounds: list[list[Group]]):
    calls: list[tuple[int, int]] = []

    def resample(num_groups: int, round_index: int) -> list[Group]:
        calls.append((num_groups, round_index))
        return rounds[round_index - 1][:num_groups]

    return resample, calls


def test_spec_8_zero_variance_resampled_group_fills_the_slot() -> None:
    batch = [Group("g0", (1, 0, 1, 0)), Group("g1", (2, 2, 2, 2))]
    resample, calls = _resampler([[Group("r1", (0.5, 0.5, 0.5, 0.5))]])
    out = dynamic_sample(batch, resample, max_resample_times=1)
    assert calls == [(1, 1)]  # exactly one extra round for one slot
    assert [g.name for g in out.groups] == ["g0", "r1"]
    assert (out.zero_var_groups, out.resample_rounds, out.filled_with_zero_var) == (1, 1, 1)
    assert out.metrics()["dynamic_sample/filled_with_zero_var"] == 1.0


def test_resampled_group_with_signal_replaces_the_dropped_one() -> None:
    batch = [Group("g0", (2, 2)), Group("g1", (0, 1)), Group("g2", (3, 3))]
    resample, calls = _resampler([[Group("r1a", (1, 0)), Group("r1b", (4, 4))], [Group("r2", (0, 5))]])
    out = dynamic_sample(batch, resample, max_resample_times=2)
    assert calls == [(2, 1), (1, 2)]
    assert [g.name for g in out.groups] == ["g1", "r1a", "r2"]
    assert (out.zero_var_groups, out.resample_rounds, out.filled_with_zero_var) == (2, 2, 0)


def test_fillers_come_from_the_last_round_in_generation_order() -> None:
    batch = [Group("g0", (2, 2)), Group("g1", (3, 3)), Group("g2", (0, 1))]
    resample, _ = _resampler([[Group("r1a", (1, 1)), Group("r1b", (0, 0))]])
    out = dynamic_sample(batch, resample, max_resample_times=1)
    assert [g.name for g in out.groups] == ["g2", "r1a", "r1b"]
    assert out.filled_with_zero_var == 2


def test_no_resampling_when_every_group_has_signal_or_disabled() -> None:
    batch = [Group("g0", (0, 1)), Group("g1", (5, 5))]
    resample, calls = _resampler([])
    assert dynamic_sample(batch[:1], resample, max_resample_times=1).resample_rounds == 0
    off = dynamic_sample(batch, resample, max_resample_times=1, enabled=False)
    assert off.groups == batch and off.zero_var_groups == 1 and off.filled_with_zero_var == 0
    zero_rounds = dynamic_sample(batch, resample, max_resample_times=0)
    assert [g.name for g in zero_rounds.groups] == ["g0", "g1"] and zero_rounds.filled_with_zero_var == 1
    assert calls == []


def test_callback_count_is_checked() -> None:
    with pytest.raises(ValueError, match="asked for 1"):
        dynamic_sample([Group("g", (1, 1))], lambda n, r: [], max_resample_times=1)


def test_is_zero_variance_is_exact() -> None:
    assert is_zero_variance([0.3, 0.3]) and not is_zero_variance([0.3, 0.30000001])

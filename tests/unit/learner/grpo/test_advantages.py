"""Advantages (docs/ALGORITHM.md#advantages; the three examples are required tests of §8)."""

from __future__ import annotations

import pytest
import torch

from learner.grpo.advantages import compute_advantages, sequence_kl, zero_variance_groups

TWO_GROUPS = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize(
    ("rewards", "estimator", "scale", "expected"),
    [
        ([1, 2, 3, 4], "grpo", "group", [-1.1618, -0.3873, 0.3873, 1.1618]),
        (TWO_GROUPS.tolist(), "reinforce_plus_plus", "batch", [-1.7746, -0.5915, 0.5915, 1.7746, 0, 0, 0, 0]),
        (TWO_GROUPS.tolist(), "grpo", "batch", [-0.9486, -0.3162, 0.3162, 0.9486, 0, 0, 0, 0]),
    ],
    ids=["spec3.1-grpo-group", "spec3.1-rpp-batch", "spec3.1-grpo-batch"],
)
def test_spec_examples(rewards: list[float], estimator: str, scale: str, expected: list[float]) -> None:
    adv = compute_advantages(torch.tensor(rewards), 4, estimator=estimator, scale_rewards=scale)
    assert adv.tolist() == pytest.approx(expected, abs=1e-4)


def test_none_scaling_is_centering_only() -> None:
    for estimator in ("grpo", "reinforce_plus_plus"):
        adv = compute_advantages(TWO_GROUPS, 4, estimator=estimator, scale_rewards="none")
        assert adv.tolist() == pytest.approx([-1.5, -0.5, 0.5, 1.5, 0, 0, 0, 0])


def test_rpp_group_scaling_uses_group_std_of_centered() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 10.0, 10.0])
    adv = compute_advantages(rewards, 4, estimator="reinforce_plus_plus", scale_rewards="group")
    s2 = torch.tensor([-5.0, -5.0, 5.0, 5.0]).std().item()
    assert adv[4:].tolist() == pytest.approx(
        [-5 / (s2 + 1e-4), -5 / (s2 + 1e-4), 5 / (s2 + 1e-4), 5 / (s2 + 1e-4)]
    )
    assert adv[:4].tolist() == pytest.approx([-1.1618, -0.3873, 0.3873, 1.1618], abs=1e-4)


def test_kl_in_reward_subtracts_beta_kl_before_centering() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0])
    kl = torch.tensor([0.0, 10.0, 0.0, 10.0])
    adv = compute_advantages(
        rewards, 4, estimator="reinforce_plus_plus", scale_rewards="none", kl_in_reward=True, beta=0.1, kl=kl
    )
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])
    # KL in the loss instead: rewards untouched
    plain = compute_advantages(
        rewards, 4, estimator="reinforce_plus_plus", scale_rewards="none", beta=0.1, kl=kl
    )
    assert plain.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_sequence_kl_sums_masked_tokens() -> None:
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -9.0], [-2.0, -2.0, -5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert sequence_kl(logps, ref, mask).tolist() == pytest.approx([0.5, 7.0])


def test_dtype_is_kept_and_errors_are_named() -> None:
    assert compute_advantages(TWO_GROUPS.to(torch.float32), 4).dtype == torch.float32
    with pytest.raises(ValueError, match="whole number of groups"):
        compute_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="reinforce_plus_plus only"):
        compute_advantages(torch.ones(4), 4, estimator="grpo", kl_in_reward=True, beta=0.1, kl=torch.ones(4))
    with pytest.raises(ValueError, match="needs kl"):
        compute_advantages(torch.ones(4), 4, kl_in_reward=True, beta=0.1)
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages(torch.ones(4), 4, scale_rewards="global")


def test_zero_variance_groups() -> None:
    assert zero_variance_groups(TWO_GROUPS, 4).tolist() == [False, True]

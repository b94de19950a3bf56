"""Per-token GRPO loss (docs/ALGORITHM.md#grpo-loss)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.grpo.loss import grpo_loss, k3_kl


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logps, advantages, mask


def test_on_policy_without_kl_is_minus_mean_advantage() -> None:
    logps, advantages, mask = _batch()
    out = grpo_loss(logps, advantages, mask, beta=0.0)
    assert out.loss.item() == pytest.approx(-(1.0 - 2.0) / 2)
    out.loss.backward()
    # d/dlogp of −ρA/n_i (ρ = exp(logp − stopgrad(logp))) = −A/n_i / B, padding gets none
    expected = torch.tensor([[-1 / 3, -1 / 3, -1 / 3], [1.0, 1.0, 0.0]]) / 2
    assert torch.allclose(logps.grad, expected)


def test_tokens_averaged_per_completion_then_batch() -> None:
    logps = torch.zeros(2, 4)
    old = torch.zeros(2, 4)
    old[0, 0] = math.log(2.0)  # ratio 0.5 on one token of completion 0
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out = grpo_loss(logps, torch.tensor([1.0, 1.0]), mask, old_logps=old, beta=0.0, epsilon=0.2)
    # completion 0: tokens −min(0.5, 0.8)=−0.5 and −1 → mean −0.75; completion 1: −1 → batch mean −0.875
    assert out.loss.item() == pytest.approx(-0.875)
    assert out.clip_ratio.item() == pytest.approx(0.0)  # min picks the unclipped 0.5


def test_clipping_for_positive_and_negative_advantages() -> None:
    logps = torch.zeros(2, 1)
    old = torch.tensor([[-math.log(2.0)], [math.log(2.0)]])  # ratios 2.0 and 0.5
    mask = torch.ones(2, 1)
    out = grpo_loss(logps, torch.tensor([1.0, -1.0]), mask, old_logps=old, beta=0.0, epsilon=0.2)
    # A>0, ρ=2: −min(2, 1.2) = −1.2; A<0, ρ=0.5: −min(−0.5, −0.8) = 0.8
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert out.clip_ratio.item() == pytest.approx(1.0)


def test_k3_term_added_only_when_kl_not_in_reward() -> None:
    logps = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    k3 = k3_kl(logps, ref)
    r = ref - logps
    assert torch.allclose(k3, torch.exp(r) - r - 1)
    with_kl = grpo_loss(logps, torch.zeros(1), mask, ref_logps=ref, beta=0.04)
    assert with_kl.loss.item() == pytest.approx(0.04 * k3.mean().item())
    assert with_kl.kl_mean.item() == pytest.approx(k3.mean().item())
    in_reward = grpo_loss(logps, torch.zeros(1), mask, ref_logps=ref, beta=0.04, kl_in_reward=True)
    assert in_reward.loss.item() == pytest.approx(0.0)


def test_missing_reference_and_shape_errors() -> None:
    logps, advantages, mask = _batch()
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, advantages, mask, beta=0.04)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logps, advantages[:1], mask, beta=0.0)


def test_empty_completion_contributes_zero() -> None:
    out = grpo_loss(torch.zeros(2, 2), torch.tensor([1.0, 5.0]), torch.tensor([[1, 1], [0, 0]]), beta=0.0)
    assert out.loss.item() == pytest.approx(-0.5)


def test_tis_weights_truncate_the_learner_over_rollout_ratio():
    from learner.grpo.loss import tis_weights

    logps = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.3]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.9], [0.3, 0.1, 0.3]]))
    known = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = tis_weights(logps, rollout, known, mask, mode="token", cap=1.5)
    # ratios 2 (capped at 1.5), 0.5, 1 | 1, 3 (capped), 1 (no server log-prob / padding: weight 1)
    assert torch.allclose(token, torch.tensor([[1.5, 0.5, 1.0], [1.0, 1.5, 1.0]]))
    sequence = tis_weights(logps, rollout, known, mask, mode="sequence", cap=2.0)
    # products 2 * 0.5 * 1 = 1 and 1 * 3 = 3 (capped at 2), one weight per completion
    assert torch.allclose(sequence, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]))
    assert torch.equal(tis_weights(logps, rollout, known, mask, mode="off", cap=2.0), torch.ones(2, 3))


def test_is_weights_scale_the_policy_gradient_term_only():
    logps = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    plain = grpo_loss(logps, adv, mask, beta=0.0)
    weighted = grpo_loss(logps, adv, mask, beta=0.0, is_weights=torch.tensor([[2.0, 0.0]]))
    assert float(plain.loss) == -1.0 and float(weighted.loss) == -1.0  # (-2 + 0) / 2
    (grad,) = torch.autograd.grad(weighted.loss, logps)
    assert torch.allclose(grad, torch.tensor([[-1.0, 0.0]]))

"""Per-token GRPO loss (docs/ALGORITHM.md#grpo-loss).

Per token ``t`` of completion ``i``: ``ρ = exp(log π − log π_old)``,
``ℓ = −min(ρ·A_i, clip(ρ, 1−ε, 1+ε)·A_i)``, plus ``β·(exp(log π_ref − log π) − (log π_ref − log π) − 1)``
(the k3 KL estimator) when the KL is a loss term (``kl_in_reward`` false, ``β > 0``). Tokens are averaged
per completion, then completions over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GrpoLossOutput:
    """Loss and detached metrics of one micro-batch.

    Attributes:
        loss: scalar, differentiable w.r.t. the policy log-probs.
        kl_mean: mean over completions of the per-completion token-mean k3 KL (0 without a reference).
        clip_ratio: fraction of completion tokens whose clipped term was the active one.
    """

    loss: torch.Tensor
    kl_mean: torch.Tensor
    clip_ratio: torch.Tensor


def _per_completion_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # A completion with no tokens contributes 0 instead of dividing by zero.
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator ``exp(r) − r − 1`` with ``r = log π_ref − log π`` (always >= 0)."""
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.04,
    epsilon: float = 0.2,
    kl_in_reward: bool = False,
    is_weights: torch.Tensor | None = None,
) -> GrpoLossOutput:
    """The §3.2 loss over a padded micro-batch.

    Args:
        logps: ``[B, T]`` policy log-probs of the sampled completion tokens (requires grad).
        advantages: ``[B]`` advantage per completion.
        mask: ``[B, T]`` 1 on completion tokens, 0 on padding (any dtype; cast to ``logps.dtype``).
        old_logps: ``[B, T]`` log-probs of the sampling policy; ``None`` means on-policy (``ρ = 1`` in value,
            gradient of ``log π`` kept).
        ref_logps: ``[B, T]`` reference-policy log-probs; required when the KL is a loss term.
        beta: KL coefficient.
        epsilon: PPO clip range.
        kl_in_reward: the KL was already subtracted from the rewards; no KL loss term.
        is_weights: ``[B, T]`` off-policy correction weights multiplying the policy-gradient term per token
            (``tis_weights``; detached); ``None`` = 1.

    Returns:
        :class:`GrpoLossOutput`.

    Raises:
        ValueError: shape mismatch, or ``ref_logps`` missing while the KL term is active.
    """
    if logps.dim() != 2 or mask.shape != logps.shape or advantages.shape != logps.shape[:1]:
        raise ValueError(
            f"expected logps/mask [B, T] and advantages [B]; got {tuple(logps.shape)}, "
            f"{tuple(mask.shape)}, {tuple(advantages.shape)}"
        )
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv
    per_token = -torch.min(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(logps.dtype)
    kl_term = not kl_in_reward and beta > 0
    if kl_term and ref_logps is None:
        raise ValueError("beta > 0 with kl_in_reward false needs ref_logps for the k3 KL term")
    kl_mean = torch.zeros((), dtype=logps.dtype, device=logps.device)
    if ref_logps is not None:
        kl = k3_kl(logps, ref_logps)
        kl_mean = _per_completion_mean(kl.detach(), mask).mean()
        if kl_term:
            per_token = per_token + beta * kl
    loss = _per_completion_mean(per_token, mask).mean()
    is_clipped = (clipped < unclipped).to(logps.dtype)
    clip_ratio = (is_clipped * mask).sum() / mask.sum().clamp(min=1)
    return GrpoLossOutput(loss=loss, kl_mean=kl_mean, clip_ratio=clip_ratio.detach())


def tis_weights(
    logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    rollout_mask: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    cap: float,
) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(π_learner / π_rollout, cap)`` (detached), the off-policy
    correction for completions sampled by the rollout engine (stale weights, or engine-vs-learner numerics).

    Args:
        logps: ``[B, T]`` learner log-probs of the sampled tokens (detached here).
        rollout_logps: ``[B, T]`` the server's sampling log-probs.
        rollout_mask: ``[B, T]`` 1 where the server returned a log-prob (elsewhere the weight is 1).
        mask: ``[B, T]`` completion tokens.
        mode: ``token`` (one weight per token) or ``sequence`` (one per completion: the product of its token
            ratios, capped); ``off`` gives ones.
        cap: the truncation (>= 1).

    Returns:
        ``[B, T]`` weights.
    """
    if mode == "off":
        return torch.ones_like(logps)
    known = (rollout_mask * mask).to(logps.dtype)
    log_ratio = (logps.detach() - rollout_logps.to(logps.dtype)) * known
    if mode == "token":
        return torch.exp(log_ratio).clamp(max=cap)
    if mode == "sequence":
        return torch.exp(log_ratio.sum(dim=-1, keepdim=True)).clamp(max=cap).expand_as(logps).clone()
    raise ValueError(f"grpo.tis_mode {mode!r}: expected off, token or sequence")

"""Group-normalized advantages (docs/ALGORITHM.md#advantages).

Completions are laid out group-major: ``rewards[g * G + j]`` is completion ``j`` of prompt ``g``. "Batch"
statistics are over the whole tensor passed in, so callers pass the generation batch gathered from every
learner rank. Standard deviations are unbiased (``correction=1``); a group needs ``G >= 2`` for that.
"""

from __future__ import annotations

from typing import Literal

import torch

AdvantageEstimator = Literal["grpo", "reinforce_plus_plus"]
ScaleRewards = Literal["group", "batch", "none"]

ADVANTAGE_EPS = 1e-4
"""ε added to the standard deviation before dividing (§3.1)."""


def sequence_kl(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``KL_i = Σ_t (log π − log π_ref)`` over the completion tokens of each row.

    Args:
        logps: ``[B, T]`` policy log-probs of the sampled tokens.
        ref_logps: ``[B, T]`` reference log-probs of the same tokens.
        mask: ``[B, T]`` 1 for completion tokens, 0 for padding.

    Returns:
        ``[B]`` summed log-ratio per completion.
    """
    return ((logps - ref_logps) * mask).sum(dim=-1)


def _grouped(values: torch.Tensor, num_generations: int) -> torch.Tensor:
    if values.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D [num_groups * num_generations], got shape {tuple(values.shape)}"
        )
    if num_generations < 2:
        raise ValueError(f"num_generations={num_generations}: a group needs at least 2 completions for a std")
    if values.numel() % num_generations:
        raise ValueError(
            f"{values.numel()} rewards are not a whole number of groups of num_generations={num_generations}"
        )
    return values.view(-1, num_generations)


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    estimator: AdvantageEstimator = "reinforce_plus_plus",
    scale_rewards: ScaleRewards = "batch",
    kl_in_reward: bool = False,
    beta: float = 0.0,
    kl: torch.Tensor | None = None,
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """Advantages ``A_i`` for every completion (§3.1).

    * ``grpo``: ``(R_i − mean_group(R)) / (s + ε)``, ``s`` the group std, the batch std of the raw rewards, or
      ``s + ε := 1`` for ``none``.
    * ``reinforce_plus_plus``: ``R' = R − β·KL`` when ``kl_in_reward`` (else ``R' = R``),
      ``Ã = R' − mean_group(R')``, ``A = Ã / (s + ε)`` with ``s`` the batch std of ``Ã``, the group std of
      ``Ã``, or no scaling for ``none``.

    Args:
        rewards: ``[N]`` total rewards, group-major, ``N % num_generations == 0``.
        num_generations: group size ``G`` (>= 2).
        estimator: ``grpo`` or ``reinforce_plus_plus``.
        scale_rewards: ``group``, ``batch`` or ``none``.
        kl_in_reward: subtract ``beta * kl`` from the rewards (``reinforce_plus_plus`` only).
        beta: KL coefficient.
        kl: ``[N]`` per-completion summed KL (:func:`sequence_kl`); required when ``kl_in_reward`` and
            ``beta > 0``.
        eps: ε of the denominator.

    Returns:
        ``[N]`` advantages in ``rewards.dtype`` (the default float dtype for integer rewards), computed in
        float64.

    Raises:
        ValueError: bad shapes, ``G < 2``, an unknown mode, ``kl_in_reward`` with ``grpo`` or without ``kl``.
    """
    values = _grouped(rewards.detach().to(torch.float64), num_generations)
    if kl_in_reward and estimator != "reinforce_plus_plus":
        raise ValueError(f"kl_in_reward is defined for reinforce_plus_plus only, not estimator={estimator!r}")
    if kl_in_reward and beta > 0:
        if kl is None or kl.shape != rewards.shape:
            raise ValueError(
                "kl_in_reward with beta > 0 needs kl of the same shape as rewards (see sequence_kl)"
            )
        values = values - beta * _grouped(kl.detach().to(torch.float64), num_generations)
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r}; use 'group', 'batch' or 'none'")
    centered = values - values.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        scaled_source = values
    elif estimator == "reinforce_plus_plus":
        scaled_source = centered
    else:
        raise ValueError(f"advantage_estimator={estimator!r}; use 'grpo' or 'reinforce_plus_plus'")
    if scale_rewards == "none":
        advantages = centered
    elif scale_rewards == "group":
        advantages = centered / (scaled_source.std(dim=1, keepdim=True) + eps)
    else:
        advantages = centered / (scaled_source.std() + eps)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    return advantages.reshape(-1).to(out_dtype)


def zero_variance_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``[num_groups]`` bool: every completion of the group has exactly the same total reward (§3.4)."""
    grouped = _grouped(rewards, num_generations)
    return (grouped == grouped[:, :1]).all(dim=1)

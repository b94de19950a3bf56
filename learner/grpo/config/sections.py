"""The ``grpo:`` section (docs/ALGORITHM.md#grpo-config, GRPO §3). ``server:`` has one schema,
``shared_schemas.server_config.ServerConfig``, which GRPO validates with the server's own models
(``learner.grpo.config.rules`` adds only the cross-section rules)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared_schemas.config import ConfigSection

__all__ = ["GrpoConfig"]


class GrpoConfig(ConfigSection):
    """``grpo:`` — the knobs of docs/ALGORITHM.md#grpo-knobs with their defaults."""

    num_generations: int = Field(default=4, ge=2)
    """Completions per prompt (group size G)."""
    temperature: float = Field(default=0.7, gt=0.0)
    """Sampling temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    """None = off."""
    repetition_penalty: float = Field(default=1.05, gt=0.0)
    max_completion_length: int = Field(default=4096, ge=1)
    """Tokens per completion; hitting it marks the completion truncated."""
    global_max_length: int = Field(default=12000, ge=2)
    """Prompt + completion budget."""
    beta: float = Field(default=0.04, ge=0.0)
    """KL coefficient (reference = the initial policy, adapters disabled)."""
    advantage_estimator: Literal["grpo", "reinforce_plus_plus"] = "reinforce_plus_plus"
    scale_rewards: Literal["group", "batch", "none"] = "batch"
    kl_in_reward: bool = False
    """KL subtracted from the reward (reinforce_plus_plus only) instead of a loss term."""
    generation_batch_size: int | None = Field(default=None, ge=1)
    """Completions generated per step; None = the effective batch size."""
    steps_per_generation: Literal[1] = 1
    num_iterations: Literal[1] = 1
    epsilon: float = Field(default=0.2, gt=0.0, lt=1.0)
    """PPO clip range."""
    tis_mode: Literal["auto", "off", "token", "sequence"] = "auto"
    """Truncated importance sampling from the server's rollout log-probs: the policy-gradient term of each
    token is weighted by min(π_learner / π_rollout, tis_cap), per token or per completion; auto = token when
    rollout.async.enabled (one step off-policy), else off."""
    tis_cap: float = Field(default=2.0, ge=1.0)
    """Truncation of the importance weights (tis_mode token / sequence)."""
    dynamic_sample: bool = True
    """Resample zero-variance groups (§3.4)."""
    max_resample_times: int = Field(default=1, ge=0)
    truncation_strategy: Literal["delete"] = "delete"
    aligner_lr: float = Field(default=1e-6, gt=0.0)
    """Learning rate of the vision-language aligner (base rate: training.learning_rate, default 5e-6)."""
    vision_tower_lr: float = Field(default=1e-8, gt=0.0)
    """Learning rate of the vision tower when it is trained."""
    freeze_vision_tower: bool = True
    """Freeze the vision tower of a VL model (GRPO's spelling of `model.freeze_vision`; the two must agree
    when both are set). The server presets keep it frozen."""
    reward_preset: Literal[
        "server", "attr_key", "detection", "detection_dedup", "detection_count", "detection_iou50"
    ] = "server"
    """Reward weight preset: the §5.3 summary presets, or `detection` (stage-2 records: F1 at the matching
    gate, mean maskIoU of the matches, format; docs/GRPO.md), or `detection_dedup` (the same plus precision
    and the duplicate-free rate, 0.5 each: prices repeated and unmatched predictions), or `detection_count`
    (F1, maskIoU, format, the duplicate-free rate and `1 − |pred − GT| / GT`, 0.5 each: prices duplicates and
    a wrong count from both sides, not leaving out an uncertain object), or `detection_iou50`
    (`detection_count` with F1 at maskIoU 0.5 in place of F1 at the matching gate: only tight boxes earn the
    F1 term)."""
    reward_weights: dict[str, float] = Field(default_factory=dict)
    """Per-reward overrides on top of the preset (weight 0 = logged only)."""
    reward_schema_path: str | None = None
    """Schema file of summary.schema_tree (required when that reward is weighted); made absolute."""

    @model_validator(mode="after")
    def _kl_in_reward_needs_rpp(self) -> GrpoConfig:
        if self.kl_in_reward and self.advantage_estimator != "reinforce_plus_plus":
            raise ValueError(
                "kl_in_reward is defined for advantage_estimator reinforce_plus_plus only (§3.1)"
            )
        return self

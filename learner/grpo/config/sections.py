"""GRPO configuration sections (docs/ALGORITHM.md#grpo-config, GRPO §2.2, §3): the ``grpo:`` knobs and the
GRPO view of ``server:`` (the server process validates its own copy with ``rollout_server.config``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.grpo.config.batch_plan import GpuList

__all__ = ["GrpoConfig", "GrpoServerConfig", "GrpoServerVllmConfig"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class GrpoServerVllmConfig(_Section):
    """``server.vllm`` as GRPO allows it: the §2.2 knobs plus the allow-listed optional engine keys."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs per engine replica."""
    data_parallel_size: int = Field(default=6, ge=1)
    """Engine replicas behind the one endpoint."""
    gpu_memory_utilization: float = Field(default=0.6, gt=0.0, le=1.0)
    """Fraction of each GPU vLLM may use; raise once stable."""
    max_model_len: int = Field(default=12000, ge=1)
    """Prompt + completion limit; >= grpo.global_max_length."""
    enable_lora: bool = False
    """MUST be false: weights are synced as full merged weights."""
    enable_prefix_caching: bool = True
    """Reset after every weight sync."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    enforce_eager: bool | None = None
    limit_mm_per_prompt: dict[str, int] | None = None
    disable_custom_all_reduce: bool | None = None
    engine_kwargs: dict[str, Any] | None = None
    mm_processor_cache_gb: float | None = Field(default=None, ge=0.0)
    disable_cascade_attn: bool | None = None
    quantization: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    """e.g. ``{do_resize: false}`` keeps image-token counts identical to the learner."""


class GrpoServerConfig(_Section):
    """``server:`` as the GRPO resolver checks it (the server process validates its own copy)."""

    host: str = "127.0.0.1"
    """Bind address; loopback unless ``allow_non_loopback``."""
    port: int = Field(default=8080, ge=1, le=65535)
    """HTTP port."""
    gpus: GpuList = (0, 1, 2, 3, 4, 5)
    """Rollout GPUs (``CUDA_VISIBLE_DEVICES`` of the server)."""
    allow_non_loopback: bool = False
    """Allow an address reachable from other hosts (then ``auth_token`` or ``allow_unauthenticated``)."""
    auth_token: str | None = Field(default=None, min_length=1)
    """Bearer token (passed through, never printed); required with a non-loopback ``host``."""
    allow_unauthenticated: bool = False
    """Serve a non-loopback ``host`` without ``auth_token`` (trusted networks only; the server warns)."""
    model: str | None = None
    """Model directory the server loads (default: ``model.path``); made absolute."""
    backend: Literal["vllm", "hf"] = "vllm"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = Field(default=0, ge=0)
    max_body_mb: float = Field(default=1024.0, gt=0.0)
    shm_dir: str | None = None
    sync_timeout_s: float = Field(default=600.0, gt=0.0)
    vllm: GrpoServerVllmConfig = Field(default_factory=GrpoServerVllmConfig)
    hf: dict[str, Any] | None = None
    """HF backend knobs (passed through to the server)."""


class GrpoConfig(_Section):
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
    reward_preset: Literal["server", "attr_key", "detection"] = "server"
    """Reward weight preset: the §5.3 summary presets, or `detection` (stage-2 records: F1 at the matching
    gate, mean maskIoU of the matches, format; docs/GRPO.md)."""
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

"""The `training:` section: HF `TrainingArguments` keys, with the ones the learner reads typed and their
defaults spelled here, once (docs/ARCHITECTURE.md#configuration).

`RunConfig.training` stays the mapping as written; `RunConfig.training_view` is this model over it, so code
reads `cfg.training_view.seed`, never `cfg.training.get("seed", 42)`. Any other `TrainingArguments` field is
allowed and passed through as written (`learner.trainers.build.training_args` gives `TrainingArguments` the
view's values and those keys). Defaults are HF's unless a field says why ours differs; GRPO overrides two
(`learner.grpo.config.validate.GRPO_TRAINING_DEFAULTS`). Imports pydantic only at import time, so GRPO's
resolver reads the defaults without torch.

The limits that keep one optimizer step's per-request rollout seeds distinct (docs/ALGORITHM.md#seeds; the
seed rule is `learner.rollout.seeds`) are spelled here: `MAX_GAS` is checked on
`gradient_accumulation_steps`, `MAX_REQUESTS_PER_MICRO_STEP` at start-up, once the world size is known
(`learner.config.check_runtime_guards`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared_schemas.config import rule_error

__all__ = ["MAX_GAS", "MAX_REQUESTS_PER_MICRO_STEP", "TRAINING_DEFAULTS", "TrainingConfig"]

MAX_REQUESTS_PER_MICRO_STEP = 10_007
"""Rollout requests of one micro-step over all ranks (per-device batch x world size) whose seeds stay apart:
the seed rule's distance between two micro-steps."""
MAX_GAS = 99
"""Micro-steps per optimizer step whose seeds stay below the next step's (99 x 10_007 < 1_000_003, the seed
rule's distance between two optimizer steps)."""


@cache
def _argument_names() -> frozenset[str]:
    """The field names of HF `TrainingArguments` (imported on first use: transformers is heavy)."""
    from dataclasses import fields

    from transformers import TrainingArguments

    return frozenset(f.name for f in fields(TrainingArguments))


class TrainingConfig(BaseModel):
    """`training:` — passed to HF `TrainingArguments` (any of its fields); the keys below are the ones the
    learner reads, with their defaults."""

    model_config = ConfigDict(extra="allow", frozen=True, use_attribute_docstrings=True)

    seed: int = 42
    """HF's seed, and the seed of the object order, the data order and the per-request rollout seeds
    (docs/ALGORITHM.md#seeds)."""
    per_device_train_batch_size: int = Field(default=8, ge=1)
    """Samples (GRPO: completions) per learner rank and micro-step."""
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    """Micro-steps per optimizer step; at most 99, or per-request seeds collide (docs/ALGORITHM.md#seeds)."""
    max_steps: int = -1
    """Optimizer steps; -1: `num_train_epochs` decides."""
    num_train_epochs: float = 3.0
    """Passes over the data when `max_steps` is -1."""
    learning_rate: float = 5e-5
    """Peak learning rate of AdamW."""
    eval_strategy: str = "no"
    """`no`, `steps` or `epoch`; anything but `no` needs `data.eval`."""
    deepspeed: str | dict[str, Any] | None = None
    """DeepSpeed config file or mapping (ZeRO); not with `stage2.offload`."""
    fsdp: str | list[str] | None = None
    """FSDP options; not with `stage2.offload`."""
    resume_from_checkpoint: str | bool | None = None
    """Checkpoint directory to resume from (true: the latest in `output_dir`); handed to `Trainer.train`,
    never to `TrainingArguments`."""
    logging_steps: float = 1
    """Log every optimizer step (HF: 500): the metrics JSONL and the live bar read every step's logs."""
    report_to: str | list[str] = Field(default_factory=lambda: ["tensorboard"])
    """TensorBoard events beside `metrics.jsonl` (HF: none)."""
    save_strategy: str = "no"
    """No checkpoints unless asked (HF: steps); `save_final_model` writes the trained policy."""
    disable_tqdm: bool = True
    """HF's bar off: the learner draws its own live bar (`learner.trainers.callbacks`)."""

    @field_validator("gradient_accumulation_steps")
    @classmethod
    def _check_gas(cls, gas: int) -> int:
        if gas > MAX_GAS:
            raise ValueError(
                f"{gas} > {MAX_GAS} collides per-request seeds (docs/ALGORITHM.md#seeds); accumulate fewer"
                " micro-steps or raise training.per_device_train_batch_size"
            )
        return gas

    @model_validator(mode="after")
    def _check_keys(self) -> TrainingConfig:
        unknown = sorted(set(self.model_extra) - _argument_names()) if self.model_extra else []
        if unknown:
            also = f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
            raise rule_error(
                unknown[0], f"not a field of HF TrainingArguments{also}; remove it or fix its spelling"
            )
        return self

    @property
    def samples_per_step(self) -> int:
        """Samples one optimizer step trains in ONE process: per-device batch x gradient accumulation."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def eval_enabled(self) -> bool:
        """Whether HF evaluates during training (`eval_strategy` other than `no`)."""
        return self.eval_strategy.lower() != "no"

    def arguments(self) -> dict[str, Any]:
        """The `TrainingArguments` keyword arguments: every typed key (set or default) and every other key as
        written, without `resume_from_checkpoint` (a `Trainer.train` argument)."""
        return self.model_dump(exclude={"resume_from_checkpoint"})


TRAINING_DEFAULTS = TrainingConfig()
"""The defaults, for code that reads a raw `training:` mapping before the run config exists (GRPO's
resolver)."""

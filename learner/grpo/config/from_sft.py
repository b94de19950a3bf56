"""Starting GRPO from an SFT run: the SFT (rollout-matching) run config turned into a GRPO run config
(docs/GRPO.md, "Starting GRPO from an SFT run")."""

from __future__ import annotations

from typing import Any

from learner.training_config import TrainingConfig
from shared_schemas.config import ConfigError, deep_merge

__all__ = ["grpo_config_from_sft"]

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty")
"""``rollout.decoding`` keys GRPO takes from ``grpo.*`` instead; the SFT run's are cleared (null)."""


def grpo_config_from_sft(
    sft_config: dict[str, Any],
    *,
    model: str,
    num_generations: int = 4,
    grpo: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The GRPO run config (``learner.grpo``, colocated HF rollouts on one GPU) of an SFT run, from ``model``.

    The SFT run's model, data, prompts, parser, matcher and batch are kept; its ``server:`` section is
    dropped; GRPO's sampling knobs come from ``grpo.*`` (temperature 1.0; ``max_completion_length`` and
    ``repetition_penalty`` from the SFT run's decoding, ``global_max_length`` from its
    ``stage2.encode``), so the SFT decoding keys are cleared and only set the held-out evaluation (its
    temperature: the SFT run's evaluation's, else its decoding's, else greedy). A step's completions are the
    SFT run's samples per step (``per_device_train_batch_size x gradient_accumulation_steps``), i.e. that
    many ÷ ``num_generations`` prompts, so both runs train the same samples per step. The learning rate is
    the SFT run's, held constant with no warm-up (GRPO continues a trained checkpoint with a fresh
    optimizer; the SFT schedule's warm-up and decay belong to that run).

    Args:
        sft_config: the SFT run's config tree, its ``extends`` chain resolved
            (``learner.yaml_loader.load_yaml_with_extends``).
        model: the checkpoint GRPO starts from (e.g. the SFT run's ``checkpoint-<step>``).
        num_generations: completions per prompt (``grpo.num_generations``).
        grpo: further ``grpo:`` keys (e.g. ``{"reward_preset": "detection"}``), over the derived ones.

    Returns:
        The GRPO run config tree, ready for ``python -m learner --config`` once written as YAML.

    Raises:
        ConfigError: the SFT run's samples per step are not a multiple of ``num_generations``.
    """
    base = {k: v for k, v in sft_config.items() if k not in ("server", "extends")}
    decoding = dict(base.get("rollout", {}).get("decoding") or {})
    completions = TrainingConfig.model_validate(base.get("training") or {}).samples_per_step
    if completions % num_generations:
        raise ConfigError(
            f"training: {completions} samples per step is not a multiple of grpo.num_generations "
            f"{num_generations}; change training.per_device_train_batch_size or num_generations"
        )
    stage2 = base.get("stage2", {})
    eval_temperature = stage2.get("eval", {}).get("temperature") or decoding.get("temperature", 0.0)
    return deep_merge(
        base,
        {
            "model": {"path": model, "freeze_vision": None},  # grpo.freeze_vision_tower decides
            "train_gpus": [0],
            "rollout": {
                "mode": "colocate",
                "backend": "hf",
                "async": {"enabled": False},
                # GRPO's sampling knobs come from grpo.*: null clears the SFT run's
                "decoding": {**dict.fromkeys(SAMPLING_KEYS), "rollout_generate_batch_size": completions},
            },
            "training": {"lr_scheduler_type": "constant", "lr_scheduler_kwargs": {}, "warmup_steps": 0},
            "stage2": {"eval": {"temperature": eval_temperature}},
            "grpo": {
                "num_generations": num_generations,
                "temperature": 1.0,
                "max_completion_length": int(decoding.get("max_new_tokens", 512)),
                "repetition_penalty": float(decoding.get("repetition_penalty", 1.0)),
                "global_max_length": int(stage2.get("encode", {}).get("global_max_length", 4096)),
                **(grpo or {}),
            },
        },
    )

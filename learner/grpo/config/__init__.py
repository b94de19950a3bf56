"""GRPO run configuration: the ``grpo:`` section, ``server:`` checked with the server's own schema, the
``batch_plan`` shorthand, the cross-section rules, :func:`validate_grpo_run` that applies them
(docs/ALGORITHM.md#grpo-config), and :func:`grpo_config_from_sft` that starts GRPO from an SFT run."""

from learner.grpo.config.from_sft import grpo_config_from_sft
from learner.grpo.config.validate import ConfigError, ResolvedGrpoRun, validate_grpo_run

__all__ = ["ConfigError", "ResolvedGrpoRun", "grpo_config_from_sft", "validate_grpo_run"]

"""GRPO run configuration: the ``grpo:`` section, ``server:`` checked with the server's own schema, the
``batch_plan`` shorthand, the cross-section rules, and :func:`validate_grpo_run` that applies them
(docs/ALGORITHM.md#grpo-config)."""

from learner.grpo.config.validate import ConfigError, ResolvedGrpoRun, validate_grpo_run

__all__ = ["ConfigError", "ResolvedGrpoRun", "validate_grpo_run"]

"""GRPO on the rollout server (spec/GRPO_SUMMARY.md).

Modules: ``advantages`` (§3.1), ``loss`` (§3.2), ``dynamic_sampling`` (§3.4), ``config`` (§2–§3 knobs and the
§2.3 validation), ``resolve`` (the launchers' config resolver CLI, §6). Nothing is re-exported here so that
``python -m learner.grpo.resolve`` stays free of torch.
"""

__all__: list[str] = []

"""GRPO on the rollout server (docs/ALGORITHM.md#grpo).

Modules: ``advantages`` (§3.1), ``loss`` (§3.2), ``dynamic_sampling`` (§3.4), ``config`` (the ``grpo:``
and GRPO ``server:`` sections, ``batch_plan`` §2.4, the §2.3 rules and ``validate_grpo_run``),
``resolve`` (the launchers' resolver CLI, §6; ``read_resolved.sh`` is its bash reader). Nothing is
re-exported here so that ``python -m learner.grpo.resolve`` never imports torch.
"""

__all__: list[str] = []

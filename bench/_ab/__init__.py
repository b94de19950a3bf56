"""The parts of ``bench/ab_learning.py``, one concern each: ``tables`` (tasks, arms, controls), ``prepare``
(the task's data and base model), ``run_configs`` (each run's YAML), ``processes`` (learner runs, the
rollout server), ``order`` (the base order ``sft-canonical`` trains in), ``canonical_budget`` (its steps,
from the arms' seconds), ``gpus`` (the GPUs a run holds: its GPU-seconds), ``step_prices`` (runs side by
side read at their arm's step price, measured alone), ``run_folder`` (reading a run folder),
``seconds_grid`` (runs read at equal training seconds), ``summary`` (per-arm lines and paired differences),
``plots`` (``ab.png``, ``grpo.png``), ``from_runs`` (``--from-runs``) and ``harness`` (one invocation's
runs). The command line is ``bench/ab_learning.py``'s.
"""

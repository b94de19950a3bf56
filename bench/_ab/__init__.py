"""The parts of ``bench/ab_learning.py``, one concern each: ``tables`` (tasks, arms, controls), ``prepare``
(the task's data and base model), ``run_configs`` (each run's YAML), ``processes`` (learner runs, the rollout
server), ``order`` (the base order ``sft-canonical`` trains in), ``run_folder`` (reading a run folder),
``summary`` (per-arm lines and paired differences), ``plots`` (``ab.png``, ``grpo.png``), ``from_runs``
(``--from-runs``) and ``harness`` (one invocation's runs). The command line is ``bench/ab_learning.py``'s.
"""

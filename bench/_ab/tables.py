"""The A/B's tables: the tasks (``TASKS``), the supervised arms (``ARMS``), the GRPO arms (``GRPO_ARMS``) and
the controls (``CONTROLS``), and where the harness runs from (``REPO``, ``PY``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


PY = sys.executable


ARMS: dict[str, dict[str, Any]] = {
    "sft": {},
    "rm-keep": {"targets": {"unmatched_prefix": "keep"}},
    # keep, plus a loss on what plain SFT never sees: the false positives (duplicates included) of the rollout
    "rm-keep-ul": {"targets": {"unmatched_prefix": "keep"}, "loss": {"fp_unlikelihood_weight": 1.0}},
    # at weight 1.0 the loss cut recall by 0.22 (the model learned to emit less): a third of it, on every
    # coordinate of a false positive or only on the first (where the model decided to place one)
    "rm-keep-ul03": {"targets": {"unmatched_prefix": "keep"}, "loss": {"fp_unlikelihood_weight": 0.3}},
    "rm-keep-ul01": {"targets": {"unmatched_prefix": "keep"}, "loss": {"fp_unlikelihood_weight": 0.1}},
    "rm-keep-ul03-first": {
        "targets": {"unmatched_prefix": "keep"},
        "loss": {"fp_unlikelihood_weight": 0.3, "fp_unlikelihood_tokens": "first_coord"},
    },
    # every weight above cut recall the same way: the penalty only on duplicates (a repeat of an object
    # another prediction found), which no correct answer holds
    "rm-keep-ul-dup": {
        "targets": {"unmatched_prefix": "keep"},
        "loss": {"fp_unlikelihood_weight": 1.0, "fp_unlikelihood_objects": "duplicates"},
    },
    "rm-drop": {"targets": {"unmatched_prefix": "drop"}},
    "rm-reorder": {"targets": {"unmatched_prefix": "reorder", "reorder_orders": ["listed"]}},
    # the same targets with each rollout reused for m optimizer steps (1 E-step + m - 1 M-steps): 1/m of the
    # generation per step, the price that decides the A/B at equal GPU-seconds, on 1/m the distinct samples
    **{
        f"rm-reorder-m{m}": {
            "targets": {"unmatched_prefix": "reorder", "reorder_orders": ["listed"]},
            "rollout_buffer": {"enabled": True, "m_steps": m},
        }
        for m in (2, 4, 8)
    },
    # the crowded tasks' base saw sorted answers: its rollouts follow the anchor order whatever the GT lists
    "rm-reorder-sorted": {"targets": {"unmatched_prefix": "reorder", "reorder_orders": ["listed", "sorted"]}},
}
"""Arm name → ``stage2`` override (deep-merged over the task config's stage2). Every arm trains on the plain
GT for ``--base-steps`` (identical across arms for a seed: the runs are deterministic), then ``sft`` continues
on the plain GT and the others roll out."""


def reuses_rollouts(arm: str) -> bool:
    """Whether supervised arm ``arm`` reuses each rollout for further steps (``stage2.rollout_buffer``). Such
    an arm resumes the seed's base checkpoint instead of training the base itself: the buffer repeats every
    window of the dataloader, the plain-GT ones of the base phase too, which would give it another base."""
    buffer = ARMS.get(arm, {}).get("rollout_buffer", {})
    return bool(buffer.get("enabled")) and buffer.get("m_steps", 1) > 1


CANONICAL = "sft-canonical"
"""The strong control: plain SFT from the seed's base on the annotations in the order the base itself follows,
measured on its own rollouts of ``--order-samples`` training items (`_ab.order.measure_base_order`); the
base's habit then costs plain SFT nothing, so an on-policy arm must beat more than the order fix."""


CONTROLS = ("sft", CANONICAL)
"""The controls every other arm is paired with: ``sft`` (plain GT in the task's order, the weak control: on a
random-order task it fights the base's order habit) and :data:`CANONICAL` (the strong one)."""


ORDERING_OF = {"sorted": "sorted"}
"""A measured order (`learner.stage2.targets.order.ORDER_NAMES`) → the ``data.object_ordering`` that lists the
annotations in it; ``listed`` is the task's own ordering."""


GRPO_ARMS: dict[str, dict[str, Any]] = {
    "grpo-detection": {"reward_preset": "detection"},
    "grpo-detection-dedup": {"reward_preset": "detection_dedup"},
    # dedup's precision term paid for dropping real objects (pred ÷ GT 0.73 on the image demo): the count term
    # prices a wrong count from both sides instead
    "grpo-detection-count": {"reward_preset": "detection_count"},
    "grpo-count-lr1e-5": {"reward_preset": "detection_count", "learning_rate": 1e-5},
    # with the count right, GRPO still lost box tightness to plain SFT: F1 at maskIoU 0.5, not at the gate
    "grpo-detection-iou50": {"reward_preset": "detection_iou50"},
    # continuing a base mid-schedule (--base-steps 150), GRPO at 1e-4 fell below its base on 2026-12-07's
    # seed 0 (0.385 -> 0.339 in 50 steps): the same reward at a third of the rate
    "grpo-iou50-lr3e-5": {"reward_preset": "detection_iou50", "learning_rate": 3e-5},
    # sampling at T 1.0 spreads ~600-token completions mostly by noise; a cooler policy gives groups whose
    # rewards differ by the detections
    "grpo-dedup-t07": {"reward_preset": "detection_dedup", "temperature": 0.7},
    # the field's GRPO rates are 1e-6 – 1e-5; these arms pin theirs whatever --grpo-learning-rate says, so one
    # invocation compares rates on the same bases
    "grpo-dedup-lr1e-5": {"reward_preset": "detection_dedup", "learning_rate": 1e-5},
    "grpo-dedup-lr3e-6": {"reward_preset": "detection_dedup", "learning_rate": 3e-6},
}
"""Arm name → ``grpo`` override of a GRPO run from the seed's base checkpoint
(`_ab.run_configs.grpo_run_config`); an arm's ``learning_rate`` is the run's (else ``--grpo-learning-rate``),
not a ``grpo`` key."""


GRPO_GENERATIONS = 4
"""Completions per prompt of the GRPO arms."""


def resumes_base(arm: str) -> bool:
    """Whether ``arm`` starts from the seed's base checkpoint (the ``sft`` run's at the base steps) rather
    than training the shared plain-GT base itself: the GRPO arms, the control and the arms that reuse
    rollouts."""
    return arm in GRPO_ARMS or arm == CANONICAL or reuses_rollouts(arm)


def grpo_override(arm: str) -> dict[str, Any]:
    """The ``grpo`` section override of GRPO arm ``arm`` (its ``learning_rate`` goes to ``training``)."""
    return {k: v for k, v in GRPO_ARMS[arm].items() if k != "learning_rate"}


TASKS: dict[str, dict[str, Any]] = {
    **{
        name: {"config": f"configs/demo_{kind}_cpu.yaml", "kind": kind, "ordering": ordering, "model": model}
        for kind, model in (
            ("tiny", ".cache/models/tiny-qwen2-copy"),
            ("vlm", ".cache/models/tiny-qwen3-vl-demo"),
        )
        for ordering in ("sorted", "random")
        for name in [f"{'text' if kind == 'tiny' else 'image'}-{ordering}"]
    },
    **{
        f"crowded-{ordering}": {
            "config": "configs/crowded_vlm_gpu.yaml",
            "kind": "crowded",
            "ordering": ordering,
            "model": ".cache/models/tiny-qwen3-vl-crowded",  # one base for both orders (sorted stage-1)
        }
        for ordering in ("sorted", "random")
    },
}
"""Task name → config, kind (``tiny`` text demo, ``vlm`` image demo, ``crowded`` crowded images), object order
and the base model. The crowded tasks' base is a stage-1 trained here (`_ab.prepare.build_crowded_stage1`)."""

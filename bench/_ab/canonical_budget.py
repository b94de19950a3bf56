"""The strong control's length: ``sft-canonical`` gets the on-policy arms' training seconds, not their steps.

An on-policy step (rollouts, then a step) costs more than a plain-GT step, so at equal steps the control
would train for fewer seconds than the arm. Sized here, per seed, it trains ``ceil(arm seconds ÷ plain-GT
seconds per step)`` steps: the arm's seconds are the largest ``train_seconds`` of the seed's on-policy arms
(the slowest one), the seconds per step are the seed's ``sft`` run's (the same plain-GT step, measured after
the shared base). Its run is configured for exactly those steps, so its learning-rate schedule ends at its own
last step (never a longer schedule read mid-way). A control whose run still trained fewer seconds than the
arm (its steps ran faster or slower than the sft run's: warm-up, a busy host) is sized again at its own
measured pace, with a margin, and run again, at most :data:`MAX_TOP_UPS` times (`top_up`): the control runs
until it has used the arm's seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from _ab.seconds_grid import final_seconds
from _ab.tables import CONTROLS

TOP_UP_TOLERANCE = 0.02
"""Share of the arm's seconds a control may fall short by without being run again (round-off, a step's
jitter)."""

MAX_TOP_UPS = 2
"""Re-sizings of one seed's control at most: each is a whole run of its own length."""

TOP_UP_MARGIN = 0.05
"""Share of the arm's seconds a re-sized control is given beyond them: a CPU host's pace drifts between runs
(a text A/B's control went 0.87 → 0.79 → 0.71 s a step over three runs as the host's load fell), and a
control sized exactly at the last pace came out short again. Reading it at the arm's seconds is then reading
it at 95 % of its own schedule, well inside ``summary.STRETCH_TOLERANCE``."""


BUDGET_STAMP = "canonical_budget.json"
"""File in an ``sft-canonical`` run folder: :func:`size_canonical`'s record of how its steps were chosen."""


def size_canonical(
    arm_seconds: dict[str, float],
    sft_seconds: float | None,
    sft_steps: int,
    fallback_steps: int,
    unit: str | None = None,
) -> dict[str, Any]:
    """The control's steps from the seed's measured seconds, with the reason, as a summary record:
    ``steps``, ``reason`` and, when sized by seconds, ``arm`` (the slowest on-policy arm), ``arm_seconds``,
    ``sft_step_seconds`` and ``unit``.

    Args:
        arm_seconds: on-policy arm → its final training seconds (the seed's runs, one unit).
        sft_seconds: the seed's ``sft`` run's training seconds over its ``sft_steps`` steps (None: no run).
        fallback_steps: the steps when nothing can be sized (``--steps``): no on-policy arm, no timed sft run.
    """
    if not arm_seconds:
        return {"steps": fallback_steps, "reason": "no on-policy arm to match: --steps"}
    if not sft_seconds or sft_steps < 1:
        return {"steps": fallback_steps, "reason": "no timed sft run to price a plain-GT step: --steps"}
    arm = max(arm_seconds, key=lambda a: arm_seconds[a])
    per_step = sft_seconds / sft_steps
    steps = max(1, math.ceil(arm_seconds[arm] / per_step - 1e-9))  # round-off must not add a whole step
    return {
        "steps": steps,
        "reason": f"the seconds of {arm}, the slowest on-policy arm, at the sft run's seconds per step",
        "arm": arm,
        "arm_seconds": arm_seconds[arm],
        "sft_step_seconds": per_step,
        "unit": unit,
    }


def write_budget(run_dir: Path, budget: dict[str, Any]) -> None:
    """Stamps ``run_dir`` with the record that sized it (read back by ``--from-runs``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / BUDGET_STAMP).write_text(json.dumps(budget) + "\n")


def read_budget(run_dir: Path) -> dict[str, Any] | None:
    """The record :func:`write_budget` left in ``run_dir`` (None: a run of fixed ``--canonical-steps``)."""
    path = run_dir / BUDGET_STAMP
    return json.loads(path.read_text()) if path.exists() else None


def budget_for_seed(
    curves: dict[tuple[str, int], list[dict[str, float]]],
    units: dict[tuple[str, int], str],
    seed: int,
    steps: int,
    canonical_steps: int | None,
) -> dict[str, Any]:
    """:func:`size_canonical` from the seed's finished runs in ``curves`` (the arms' and sft's ``steps``-step
    runs, their final ``seconds``; an arm in another unit than sft's is not priced by it); a fixed
    ``canonical_steps`` (``--canonical-steps``) wins."""
    if canonical_steps is not None:
        return {"steps": canonical_steps, "reason": "--canonical-steps"}
    sft = curves.get(("sft", seed))
    unit = units.get(("sft", seed))
    arms = {
        arm: final_seconds(curve)
        for (arm, s), curve in curves.items()
        if s == seed
        and arm not in CONTROLS
        and curve
        and "seconds" in curve[-1]
        and units.get((arm, s)) == unit
    }
    sft_seconds = final_seconds(sft) if sft and "seconds" in sft[-1] else None
    return size_canonical(arms, sft_seconds, steps, steps, unit)


def top_up(budget: dict[str, Any], curve: list[dict[str, float]], steps: int) -> dict[str, Any] | None:
    """The budget of a longer control when the run of ``budget`` (``steps`` steps, its ``curve``) trained
    fewer than ``1 - TOP_UP_TOLERANCE`` of the arm's seconds: ``ceil(arm seconds x (1 + TOP_UP_MARGIN) ÷
    the control's own seconds per step)`` steps (at least one more), ``topped_up_from`` the short run's
    steps, ``top_up`` its count. None when it reached them, was not sized by seconds, or was topped up
    :data:`MAX_TOP_UPS` times."""
    arm_seconds = budget.get("arm_seconds")
    if not arm_seconds or not curve or "seconds" not in curve[-1] or steps < 1:
        return None
    got = final_seconds(curve)
    count = int(budget.get("top_up", 0)) + 1
    if got >= arm_seconds * (1 - TOP_UP_TOLERANCE) or count > MAX_TOP_UPS or got <= 0:
        return None
    pace = got / steps
    longer = max(steps + 1, math.ceil(arm_seconds * (1 + TOP_UP_MARGIN) / pace - 1e-9))
    reason = (
        f"top-up {count}: its {steps}-step run trained {got:.1f} of {budget['arm']}'s {arm_seconds:.1f} s at"
        f" {pace:.4f} s a step; sized again at that pace"
    )
    extra = {"control_step_seconds": pace, "topped_up_from": steps, "top_up": count}
    return {**budget, "steps": longer, "reason": reason, **extra}

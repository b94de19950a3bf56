"""Reading runs on one training-seconds grid: each run's held-out figures linearly interpolated between its
evaluations' ``seconds``, so that two runs are compared at the SAME seconds, never at whichever evaluation
happens to fall inside a budget.

Invariants: a curve's points are in step order with non-decreasing ``seconds`` (the base's evaluation at 0 s);
a run is never read past its last evaluation (a run that did not reach the seconds asked gives None, a
missing value, never an earlier evaluation's figure)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

GRID_FIGURES = ("f1", "precision", "recall", "duplicates", "pred_gt_ratio")
"""The held-out figures paired at equal seconds: gate F1, its precision and recall, duplicate predictions and
predicted ÷ GT objects (``eval_rollout_*`` without the prefix)."""

GRID_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""Fractions of the arm's final training seconds at which it is paired with a control; 1.0 is the headline
(the control read at the seconds the arm trained in total)."""

SECONDS_TOLERANCE = 1e-9
"""Seconds within which a grid point counts as reached (float round-off of the runs' cumulated seconds)."""


def at_seconds(curve: Sequence[dict[str, float]], figure: str, seconds: float) -> float | None:
    """``figure`` of the run ``curve`` at ``seconds`` of training: linear between the two evaluations around
    it (the later evaluation's value at a tie). None where the run did not reach ``seconds`` (past its last
    evaluation, or before its first), or an evaluation around it lacks ``figure``."""
    points = [p for p in curve if "seconds" in p]
    if not points or seconds < points[0]["seconds"] - SECONDS_TOLERANCE:
        return None
    if seconds > points[-1]["seconds"] + SECONDS_TOLERANCE:
        return None
    xs = [p["seconds"] for p in points]
    right = bisect.bisect_right(xs, seconds + SECONDS_TOLERANCE) - 1  # last evaluation at or before it
    if abs(xs[right] - seconds) <= SECONDS_TOLERANCE or right == len(points) - 1:
        return points[right].get(figure)
    after = points[right + 1]
    before = points[right]
    if figure not in before or figure not in after:
        return None
    weight = (seconds - xs[right]) / (after["seconds"] - xs[right])
    return before[figure] + weight * (after[figure] - before[figure])


def final_seconds(curve: Sequence[dict[str, float]]) -> float:
    """The seconds of the run's last evaluation: what it trained in total (its steps after the base)."""
    return curve[-1]["seconds"]


def paired_at_seconds(
    arm: Sequence[dict[str, float]], control: Sequence[dict[str, float]], figure: str, seconds: float
) -> float | None:
    """The arm's ``figure`` minus the control's, both at ``seconds`` (:func:`at_seconds`); None (a missing
    pair) when either run did not reach ``seconds``."""
    a, c = at_seconds(arm, figure, seconds), at_seconds(control, figure, seconds)
    return None if a is None or c is None else a - c


def common_grid(curves: Sequence[Sequence[dict[str, float]]], points: int = 41) -> list[float]:
    """``points`` evenly spaced seconds from 0 to the longest of ``curves``' final seconds: one x-axis on
    which every run is read (:func:`at_seconds`)."""
    longest = max((final_seconds(c) for c in curves if c), default=0.0)
    return [longest * i / (points - 1) for i in range(points)]

"""The A/B's summary lines: per arm, the final F1 over seeds and its paired differences to each control."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from _ab.seconds_grid import (
    GRID_FIGURES,
    GRID_FRACTIONS,
    SECONDS_TOLERANCE,
    at_seconds,
    final_seconds,
    paired_at_seconds,
)
from _ab.tables import CANONICAL, CONTROLS

BREAKDOWN = ("precision", "recall", "f1_iou50", "f1_iou75", "duplicates", "duplicate_rate", "pred_gt_ratio")
"""``eval_rollout_*`` figures whose per-arm mean over seeds the summary carries beside the gate F1."""


def t_quantile_975(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (two-sided 95 % interval)."""
    from scipy.stats import t

    return float(t.ppf(0.975, dof))


def paired_stats(diffs: Sequence[float]) -> dict[str, Any]:
    """Mean, sd, min and max of per-seed differences, and Student's t 95 % interval of the mean (two seeds or
    more: the acceptance asks for it above 0)."""
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    out: dict[str, Any] = {"mean": mean, "sd": sd, "min": min(diffs), "max": max(diffs)}
    if len(diffs) > 1:
        half = t_quantile_975(len(diffs) - 1) * sd / math.sqrt(len(diffs))
        out["ci95"] = [mean - half, mean + half]
    return out


def timed_seeds(
    curves: dict[tuple[str, int], list[dict[str, float]]],
    arm: str,
    control: str,
    seeds: Sequence[int],
    units: dict[tuple[str, int], str],
) -> list[int]:
    """The ``seeds`` whose two runs can be read on one seconds grid: every evaluation of both carries
    ``seconds``, in one unit (GPU-seconds are never set against a CPU host's wall seconds), and the arm
    trained for some seconds."""
    return [
        s
        for s in seeds
        if all("seconds" in p for p in curves[(arm, s)] + curves[(control, s)])
        and units.get((arm, s)) == units.get((control, s))
        and final_seconds(curves[(arm, s)]) > 0
    ]


def pair_at_seconds(
    curves: dict[tuple[str, int], list[dict[str, float]]], arm: str, control: str, seeds: Sequence[int]
) -> dict[str, Any]:
    """``arm`` against ``control`` at equal training seconds, per seed, on the arm's grid
    (:data:`~_ab.seconds_grid.GRID_FRACTIONS` of its final seconds; both runs interpolated,
    :func:`~_ab.seconds_grid.at_seconds`), as ``at_seconds_*`` keys (the caller prefixes them):

    - ``at_seconds``: the arm's final seconds per seed of ``seeds`` (the headline's grid point);
    - ``at_seconds_seeds`` / ``at_seconds_missing``: the seeds paired there / those whose control never
      reached the arm's final seconds (a missing pair, counted, never read at an earlier evaluation);
    - ``at_seconds_<figure>`` for each :data:`~_ab.seconds_grid.GRID_FIGURES` figure: ``diff`` (arm minus
      control per paired seed) and its :func:`paired_stats`, with ``arm`` and ``control`` (their values);
    - ``at_fractions_f1``: per fraction of the arm's final seconds, the paired seeds, the missing ones and
      the F1 difference's stats.
    """
    totals = {s: final_seconds(curves[(arm, s)]) for s in seeds}
    out: dict[str, Any] = {"at_seconds": [totals[s] for s in seeds]}
    for fraction in GRID_FRACTIONS:
        diffs = {
            s: paired_at_seconds(curves[(arm, s)], curves[(control, s)], "f1", fraction * totals[s])
            for s in seeds
        }
        paired = [s for s in seeds if diffs[s] is not None]
        missing = [s for s in seeds if diffs[s] is None]
        if fraction == 1.0:
            out["at_seconds_seeds"], out["at_seconds_missing"] = paired, missing
            for figure in GRID_FIGURES:
                arm_values = [at_seconds(curves[(arm, s)], figure, totals[s]) for s in paired]
                control_values = [at_seconds(curves[(control, s)], figure, totals[s]) for s in paired]
                both = [
                    (a, c)
                    for a, c in zip(arm_values, control_values, strict=True)
                    if a is not None and c is not None
                ]
                if both:
                    figure_diffs = [a - c for a, c in both]
                    out[f"at_seconds_{figure}"] = {
                        "diff": figure_diffs,
                        **paired_stats(figure_diffs),
                        "arm": [a for a, _ in both],
                        "control": [c for _, c in both],
                    }
        stats = paired_stats([diffs[s] for s in paired]) if paired else {}  # type: ignore[misc]
        out.setdefault("at_fractions_f1", {})[f"{fraction:g}"] = {
            "seeds": paired,
            "missing": missing,
            **stats,
        }
    return out


STRETCH_TOLERANCE = 0.10
"""Share of an arm's seconds by which the arm that sized its seed's ``sft-canonical`` may have trained longer
(a top-up's pace, a priced step's round-off). Beyond it the control's schedule was sized for a slower arm:
read at this arm's seconds it is mid-way through a longer schedule, not this arm's control."""


def stretched_seeds(
    curves: dict[tuple[str, int], list[dict[str, float]]], arm: str, budgets: dict[int, dict[str, Any]]
) -> list[int]:
    """The seeds whose ``sft-canonical`` was sized (``budgets``, `_ab.canonical_budget`) for another arm
    that trained more than ``1 + STRETCH_TOLERANCE`` times ``arm``'s seconds: those pairs at ``arm``'s
    seconds are left out (the fix: run ``arm`` in a folder of its own, as ``bench/equal_seconds_ab_gpu.sh``
    does, so that its control is sized to it)."""
    out = []
    for (a, seed), curve in sorted(curves.items()):
        budget = budgets.get(seed) or {}
        if a != arm or not curve or "seconds" not in curve[-1] or budget.get("arm") in (None, arm):
            continue
        if budget.get("arm_seconds", 0.0) > final_seconds(curve) * (1 + STRETCH_TOLERANCE):
            out.append(seed)
    return out


def pair_with(
    curves: dict[tuple[str, int], list[dict[str, float]]],
    arm: str,
    control: str,
    prefix: str,
    units: dict[tuple[str, int], str] | None = None,
    stretched: Sequence[int] = (),
) -> dict[str, Any]:
    """``arm`` against ``control`` over the seeds both finished, as ``<prefix>_*`` keys of a summary line.

    By trained samples (every arm trains the same samples per step), where the control's last step is the
    arm's (a control of another length is on another learning-rate schedule: read mid-way it would not be
    the control): ``<prefix>_diff``, the final F1 minus the control's final F1 of the same seed, and its
    :func:`paired_stats`; ``<prefix>_samples_unpaired`` lists the seeds left out for that. By seconds (the
    seeds of :func:`timed_seeds`, less the ``stretched`` ones, listed as ``<prefix>_stretched``:
    :func:`stretched_seeds`): :func:`pair_at_seconds`'s keys under ``<prefix>_``, and
    ``<prefix>_seconds_ratio`` (the arm's final seconds ÷ the control's).
    """
    seeds = sorted(s for a, s in curves if a == arm and (control, s) in curves)
    if arm == control or not seeds:
        return {}
    out: dict[str, Any] = {}
    same_length = [s for s in seeds if curves[(arm, s)][-1]["step"] == curves[(control, s)][-1]["step"]]
    if same_length:
        diffs = [curves[(arm, s)][-1]["f1"] - curves[(control, s)][-1]["f1"] for s in same_length]
        out[f"{prefix}_seeds"] = same_length
        out[f"{prefix}_diff"] = diffs
        out |= {f"{prefix}_{k}": v for k, v in paired_stats(diffs).items()}
    if len(same_length) < len(seeds):
        out[f"{prefix}_samples_unpaired"] = [s for s in seeds if s not in same_length]
    timed = [s for s in timed_seeds(curves, arm, control, seeds, units or {}) if s not in stretched]
    if stretched:
        out[f"{prefix}_stretched"] = sorted(set(stretched) & set(seeds))
    if timed:
        out |= {f"{prefix}_{k}": v for k, v in pair_at_seconds(curves, arm, control, timed).items()}
        out[f"{prefix}_seconds_ratio"] = [
            final_seconds(curves[(arm, s)]) / final_seconds(curves[(control, s)])
            if final_seconds(curves[(control, s)]) > 0
            else None
            for s in timed
        ]
    return out


PAIRING_PREFIX = {"sft": "paired", CANONICAL: "canonical_paired"}
"""Summary-line key prefix of the pairing with each of :data:`CONTROLS`."""


def summarize(
    task: str,
    curves: dict[tuple[str, int], list[dict[str, float]]],
    samples: dict[tuple[str, int], int] | None = None,
    units: dict[tuple[str, int], str] | None = None,
    orders: dict[tuple[str, int], dict[str, Any]] | None = None,
    budgets: dict[int, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One line per arm: final F1 mean/sd over seeds, the breakdown's means, trained samples and training
    seconds per run (the arm's steps, evaluations excluded; ``seconds_unit`` per run: ``gpu`` GPU-seconds,
    ``cpu`` wall seconds of a CPU host), and the pairing with each of :data:`CONTROLS` the arm is not
    (:func:`pair_with`: ``paired_*`` against ``sft``, ``canonical_paired_*`` against ``sft-canonical``). The
    ``sft-canonical`` line also carries the base order measured per seed (``base_order``; ``orders``), how its
    steps were chosen per seed (``canonical_budget``; ``budgets``, `_ab.canonical_budget`) and the seeds where
    it trained fewer seconds than the slowest on-policy arm (``canonical_seconds_short``,
    :func:`seconds_short`: those pairs at the arm's seconds are missing, not read early). An arm whose
    control was sized to a slower arm is not paired with it at seconds on those seeds
    (``canonical_paired_stretched``, :func:`stretched_seeds`)."""
    arms = sorted({a for a, _ in curves})
    lines = []
    for arm in arms:
        seeds = sorted(s for a, s in curves if a == arm)
        finals = [curves[(arm, s)][-1]["f1"] for s in seeds]
        line: dict[str, Any] = {
            "task": task,
            "arm": arm,
            "seeds": seeds,
            "final_f1": finals,
            "mean": statistics.fmean(finals),
            "sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_pred_objects": [curves[(arm, s)][-1]["pred"] for s in seeds],
            "start_f1": statistics.fmean(curves[(arm, s)][0]["f1"] for s in seeds),
        }
        for key in BREAKDOWN:
            values = [curves[(arm, s)][-1][key] for s in seeds if key in curves[(arm, s)][-1]]
            if values:
                line[f"mean_{key}"] = statistics.fmean(values)
        if all("seconds" in curves[(arm, s)][-1] for s in seeds):
            line["train_seconds"] = [curves[(arm, s)][-1]["seconds"] for s in seeds]
            line["seconds_unit"] = [(units or {}).get((arm, s), "wall") for s in seeds]
        if samples:
            line["trained_samples"] = [samples.get((arm, s)) for s in seeds]
        if orders and any((arm, s) in orders for s in seeds):
            line["base_order"] = [orders.get((arm, s)) for s in seeds]
        if arm == CANONICAL:
            if budgets:
                line["canonical_budget"] = [budgets.get(s) for s in seeds]
            short = seconds_short(curves, units or {})
            if short:
                line["canonical_seconds_short"] = short
        # only the sized control can be stretched, and only for an on-policy arm (sft is read inside it)
        stretched = stretched_seeds(curves, arm, budgets or {}) if arm not in CONTROLS else []
        for control in CONTROLS:
            skip = stretched if control == CANONICAL else ()
            line |= pair_with(curves, arm, control, PAIRING_PREFIX[control], units, skip)
        lines.append(line)
    return lines


def seconds_short(
    curves: dict[tuple[str, int], list[dict[str, float]]], units: dict[tuple[str, int], str]
) -> list[dict[str, Any]]:
    """Per seed where ``sft-canonical`` trained fewer seconds than the slowest on-policy arm (an arm not in
    :data:`CONTROLS`, in the same unit): the seed, that arm, its seconds and the control's. The control was
    to get the arm's seconds; short of them, the headline pair of that arm is missing."""
    short = []
    for (arm, seed), curve in sorted(curves.items()):
        if arm != CANONICAL or not curve or "seconds" not in curve[-1]:
            continue
        timed = [
            (final_seconds(c), a)
            for (a, s), c in curves.items()
            if s == seed and a not in CONTROLS and c and all("seconds" in p for p in c)
            and units.get((a, s)) == units.get((arm, seed))
        ]  # fmt: skip
        if timed and max(timed)[0] > final_seconds(curve) + SECONDS_TOLERANCE:
            seconds, slowest = max(timed)
            short.append({"seed": seed, "arm": slowest, "arm_seconds": seconds,
                          "canonical_seconds": final_seconds(curve)})  # fmt: skip
    return short

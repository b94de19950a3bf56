"""The A/B's summary lines: per arm, the final F1 over seeds and its paired differences to each control."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

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


def f1_within(curve: Sequence[dict[str, float]], budget: float) -> float:
    """F1 of the last evaluation the run reached within ``budget`` seconds of training (the base's at 0)."""
    return [p for p in curve if p["seconds"] <= budget + 1e-9][-1]["f1"]


def f1_at_step(curve: Sequence[dict[str, float]], step: float) -> float:
    """F1 of the last evaluation at or before ``step`` (the base's is the first): a control trained longer
    than the arm (``--canonical-steps``) is read where the arm stopped."""
    return [p for p in curve if p["step"] <= step][-1]["f1"]


def pair_with(
    curves: dict[tuple[str, int], list[dict[str, float]]],
    arm: str,
    control: str,
    prefix: str,
    units: dict[tuple[str, int], str] | None = None,
) -> dict[str, Any]:
    """``arm`` against ``control`` over the seeds both finished, as ``<prefix>_*`` keys of a summary line.

    By trained samples (every arm trains the same samples per step): ``<prefix>_diff``, the final F1 minus
    the control's of the same seed at the arm's final step (:func:`f1_at_step`), and its
    :func:`paired_stats`. By seconds (when every run's evaluations carry ``seconds``, in one unit per pair):
    both runs cut at the seconds the faster of the two trained (each at its last evaluation within them),
    ``<prefix>_at_seconds_diff`` and its stats, the budget per seed (``<prefix>_at_seconds_budget``) and
    ``<prefix>_seconds_ratio`` (the arm's seconds ÷ the control's).
    """
    seeds = sorted(s for a, s in curves if a == arm and (control, s) in curves)
    if arm == control or not seeds:
        return {}
    out: dict[str, Any] = {f"{prefix}_seeds": seeds}
    finals = {s: curves[(arm, s)][-1] for s in seeds}
    diffs = [finals[s]["f1"] - f1_at_step(curves[(control, s)], finals[s]["step"]) for s in seeds]
    out[f"{prefix}_diff"] = diffs
    out |= {f"{prefix}_{k}": v for k, v in paired_stats(diffs).items()}
    units = units or {}
    timed = [
        s
        for s in seeds
        if all("seconds" in p for p in curves[(arm, s)] + curves[(control, s)])
        and units.get((arm, s)) == units.get((control, s))
        and curves[(control, s)][-1]["seconds"] > 0
    ]
    if timed:
        budgets = [min(curves[(arm, s)][-1]["seconds"], curves[(control, s)][-1]["seconds"]) for s in timed]
        at = [
            f1_within(curves[(arm, s)], b) - f1_within(curves[(control, s)], b)
            for s, b in zip(timed, budgets, strict=True)
        ]
        out[f"{prefix}_at_seconds_seeds"] = timed
        out[f"{prefix}_at_seconds_budget"] = budgets
        out[f"{prefix}_at_seconds_diff"] = at
        out |= {f"{prefix}_at_seconds_{k}": v for k, v in paired_stats(at).items()}
        out[f"{prefix}_seconds_ratio"] = [
            curves[(arm, s)][-1]["seconds"] / curves[(control, s)][-1]["seconds"] for s in timed
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
) -> list[dict[str, Any]]:
    """One line per arm: final F1 mean/sd over seeds, the breakdown's means, trained samples and training
    seconds per run (the arm's steps, evaluations excluded; ``seconds_unit`` per run: ``gpu`` GPU-seconds,
    ``cpu`` wall seconds of a CPU host), and the pairing with each of :data:`CONTROLS` the arm is not
    (:func:`pair_with`: ``paired_*`` against ``sft``, ``canonical_paired_*`` against ``sft-canonical``). The
    ``sft-canonical`` line also carries the base order measured per seed (``base_order``; ``orders``)."""
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
        for control in CONTROLS:
            line |= pair_with(curves, arm, control, PAIRING_PREFIX[control], units)
        lines.append(line)
    return lines

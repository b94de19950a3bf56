"""The A/B's figures: ``ab.png`` (held-out figures per arm by step and by seconds) and ``grpo.png``."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from _ab.seconds_grid import at_seconds, common_grid
from _ab.summary import PAIRING_PREFIX, summarize
from _ab.tables import CONTROLS
from learner.report import load_metrics

PANELS = (
    ("f1", "F1 at the matching gate"),
    ("precision", "precision (gate)"),
    ("recall", "recall (gate)"),
    ("f1_iou50", "F1 at maskIoU 0.5"),
    ("duplicates", "duplicate predictions"),
    ("pred_gt_ratio", "predicted / GT objects"),
)
"""The held-out figures ``ab.png`` plots per arm (mean line, min-max band over seeds)."""


def arm_label(line: dict[str, Any]) -> str:
    """An arm's legend entry: its name, seeds, and its paired mean final F1 against each control it is not,
    by samples and (``@s``) at the arm's final seconds."""
    label = f"{line['arm']} (n={len(line['seeds'])})"
    versus = []
    for control in CONTROLS:
        prefix = PAIRING_PREFIX[control]
        parts = []
        if f"{prefix}_mean" in line:
            parts.append(f"{line[f'{prefix}_mean']:+.3f}")
        if f"{prefix}_at_seconds_f1" in line:
            parts.append(f"@s {line[f'{prefix}_at_seconds_f1']['mean']:+.3f}")
        if parts:
            versus.append(f"{control} {' '.join(parts)}")
    return label + (f" vs {', '.join(versus)}" if versus else "")


def seconds_panel(
    ax: Any, curves: dict[tuple[str, int], list[dict[str, float]]], labels: dict[str, str]
) -> None:
    """F1 by training seconds on one x-axis for every arm (`_ab.seconds_grid.common_grid`): per arm the mean
    over seeds of each run's F1 interpolated at the grid's seconds (:func:`~_ab.seconds_grid.at_seconds`) and
    the min-max band, drawn where every seed of the arm reached those seconds; its evaluations as dots."""
    grid = common_grid(list(curves.values()))
    for index, arm in enumerate(sorted({a for a, _ in curves})):
        runs = [c for (a, _), c in sorted(curves.items()) if a == arm]
        xs, values = [], []
        for x in grid:
            at = [at_seconds(run, "f1", x) for run in runs]
            if all(v is not None for v in at):
                xs.append(x)
                values.append(at)
        if not xs:
            continue
        colour = f"C{index}"
        style = "--" if arm in CONTROLS else "-"
        ax.plot(xs, [statistics.fmean(v) for v in values], style, color=colour, label=labels[arm])
        ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], color=colour, alpha=0.2)
        for run in runs:
            ax.plot([p["seconds"] for p in run], [p["f1"] for p in run], ".", color=colour, alpha=0.5)
    ax.legend(fontsize=7)  # the headline panel: its pairs are read at these seconds


def plot(
    task: str,
    curves: dict[tuple[str, int], list[dict[str, float]]],
    path: Path,
    units: dict[tuple[str, int], str] | None = None,
) -> None:
    """``ab.png``: one panel per :data:`PANELS` figure the runs logged, by step, per arm (the controls
    dashed), and the F1 by training seconds when the runs carry them (:func:`seconds_panel`: every arm on one
    seconds axis); the legend pairs each arm with both controls (:func:`arm_label`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {line["arm"]: arm_label(line) for line in summarize(task, curves, units=units)}
    panels = [(k, t) for k, t in PANELS if any(k in p for c in curves.values() for p in c)]
    if all("seconds" in p for c in curves.values() for p in c):
        panels.append(("seconds", "F1 by training seconds (GPU-s on GPUs), interpolated"))
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        ax.set_title(title, fontsize=10)
        if key == "seconds":
            seconds_panel(ax, curves, labels)
            ax.set_xlabel("training seconds")
            continue
        for index, arm in enumerate(sorted({a for a, _ in curves})):
            runs = [c for (a, _), c in sorted(curves.items()) if a == arm]
            steps = sorted({p["step"] for r in runs for p in r})
            by_step = [[p[key] for r in runs for p in r if p["step"] == step and key in p] for step in steps]
            kept = [(x, v) for x, v in zip(steps, by_step, strict=True) if v]
            if not kept:
                continue
            xs = [x for x, _ in kept]
            style = "--" if arm in CONTROLS else "-"
            colour = f"C{index}"
            means = [statistics.fmean(v) for _, v in kept]
            ax.plot(xs, means, style, marker="o", color=colour, label=labels[arm])
            ax.fill_between(xs, [min(v) for _, v in kept], [max(v) for _, v in kept], color=colour, alpha=0.2)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{task}: held-out figures, mean and min-max over seeds; controls dashed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_grpo(run_dirs: dict[tuple[str, int], Path], path: Path) -> None:
    """``grpo.png``: per GRPO run (arm, seed), the training reward, the KL to the reference and the mean
    completion length by step, from its ``metrics.jsonl``; one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (
        ("reward/total_mean", "reward (total, mean over completions)"),
        ("kl/mean", "KL to the reference"),
        ("completions/mean_length", "completion length (tokens)"),
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.4))
    colours = {arm: f"C{i}" for i, arm in enumerate(sorted({arm for arm, _ in run_dirs}))}
    for (arm, seed), run_dir in sorted(run_dirs.items()):
        rows = load_metrics(run_dir / "metrics.jsonl")
        for ax, (key, title) in zip(axes, keys, strict=True):
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points, strict=True), label=f"{arm} s{seed}", color=colours[arm], alpha=0.6)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("GRPO step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

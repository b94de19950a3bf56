"""One picture of several A/B summaries of one task: each on-policy arm against ``sft-canonical`` given the
same seconds, by the arm's step price.

    python bench/ab_sweep.py --summary m2=runs/ab/x/ab.jsonl --summary m4=... --out docs/img/sweep.png

A summary is an ``ab.jsonl`` of ``bench/ab_learning.py`` (its last line per arm counts; a log that appended
several summaries keeps the newest). For every arm paired with ``sft-canonical`` at its final seconds
(``canonical_paired_at_seconds_*``) and priced against ``sft`` (``paired_seconds_ratio``: the arm's training
seconds ÷ plain SFT's for the same steps, per seed), the picture plots each seed's difference in F1 and in
precision at that seed's price, and the mean with its t 95 % interval; the same figures print as a Markdown
table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ab.summary import PAIRING_PREFIX  # noqa: E402
from _ab.tables import CANONICAL, CONTROLS  # noqa: E402

PAIRED = f"{PAIRING_PREFIX[CANONICAL]}_at_seconds_"
"""Prefix of an arm's paired differences against :data:`CANONICAL` at its final seconds."""
PRICED = PAIRING_PREFIX["sft"]
"""Prefix of an arm's pairing with ``sft``, which holds its step price (``<PRICED>_seconds_ratio``)."""


def last_lines(path: Path) -> dict[str, dict[str, Any]]:
    """Arm → the last summary line of that arm in ``path`` (JSON lines)."""
    lines: dict[str, dict[str, Any]] = {}
    for text in path.read_text().splitlines():
        if text.strip():
            line = json.loads(text)
            lines[line["arm"]] = line
    return lines


def sweep_rows(summaries: dict[str, Path], arms: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per (label, on-policy arm) paired with :data:`CANONICAL` at equal seconds: its per-seed
    prices (÷ the ``sft`` run's seconds) and differences in F1, precision and duplicates, with means and the
    F1 interval. Seeds are those the pairing kept (``canonical_paired_at_seconds_seeds``), in its order. An
    arm counts once, from the first summary that holds it (A/Bs run into one folder summarize its earlier
    arms again, each with the control sized to it). ``arms``: only these (None: every one).

    Raises:
        ValueError: a summary holds no arm paired with :data:`CANONICAL` at equal seconds.
    """
    rows: list[dict[str, Any]] = []
    for label, path in summaries.items():
        found = False
        for arm, line in last_lines(path).items():
            if arm in CONTROLS or f"{PAIRED}f1" not in line:
                continue
            found = True
            if arms is not None and arm not in arms:
                continue
            if any(r["arm"] == arm for r in rows):  # one folder's later summaries repeat its earlier arms
                continue
            seeds = line[f"{PAIRED}seeds"]
            # the ratios run over the seeds the arm and sft both timed (paired at seconds or missing there)
            timed = {
                *line.get(f"{PRICED}_at_seconds_seeds", []),
                *line.get(f"{PRICED}_at_seconds_missing", []),
            }
            timed_seeds = [s for s in line["seeds"] if s in timed] if timed else line["seeds"]
            price = dict(zip(timed_seeds, line[f"{PRICED}_seconds_ratio"], strict=True))
            f1, precision = line[f"{PAIRED}f1"], line[f"{PAIRED}precision"]
            rows.append(
                {
                    "label": label,
                    "arm": arm,
                    "seeds": seeds,
                    "price": [price[s] for s in seeds],
                    "f1_diff": f1["diff"],
                    "f1_mean": f1["mean"],
                    "f1_ci95": f1["ci95"],
                    "precision_diff": precision["diff"],
                    "precision_mean": precision["mean"],
                    "duplicates_mean": line[f"{PAIRED}duplicates"]["mean"],
                    "ahead": sum(d > 0 for d in f1["diff"]),
                }
            )
        if not found:
            raise ValueError(
                f"{path} holds no arm paired with {CANONICAL} at equal seconds (no '{PAIRED}f1'): "
                f"summarize an A/B that ran {CANONICAL} (bench/ab_learning.py --summarize-only)"
            )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table: price range, F1 difference (mean, interval, seeds ahead, median),
    precision and duplicates."""
    out = [
        f"| run | arm | step ÷ plain | F1 − {CANONICAL}, equal seconds | seeds ahead | median | precision "
        "| duplicates |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["f1_ci95"]
        out.append(
            f"| {r['label']} | `{r['arm']}` | {min(r['price']):.2f}–{max(r['price']):.2f} × "
            f"| {r['f1_mean']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {r['ahead']} of {len(r['seeds'])} "
            f"| {statistics.median(r['f1_diff']):+.3f} | {r['precision_mean']:+.3f} "
            f"| {r['duplicates_mean']:+.0f} |"
        )
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """F1 and precision minus :data:`CANONICAL` at equal seconds (y) by the arm's step price (x): a dot per
    seed, the mean with its F1 interval as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, r in enumerate(rows):
        color = f"C{i % 10}"
        x = statistics.mean(r["price"])
        for ax, key in zip(axes, ("f1", "precision"), strict=True):
            ax.scatter(r["price"], r[f"{key}_diff"], color=color, alpha=0.45, s=18)
            ax.plot([x], [r[f"{key}_mean"]], "D", color=color, label=f"{r['label']} ({r['arm']})")
        lo, hi = r["f1_ci95"]
        axes[0].errorbar(
            [x], [r["f1_mean"]], yerr=[[r["f1_mean"] - lo], [hi - r["f1_mean"]]], color=color, capsize=4
        )
    for ax, name in zip(axes, ("F1", "precision"), strict=True):
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel("step price (training seconds ÷ plain SFT's, same steps)")
        ax.set_ylabel(f"{name} − {CANONICAL} at the arm's seconds")
        ax.set_title(f"{name}: a dot per seed, ◆ the mean" + (" (bar: t 95 %)" if name == "F1" else ""))
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--summary",
        action="append",
        required=True,
        metavar="LABEL=PATH",
        help="an ab.jsonl, with the label its arm gets in the picture (repeatable)",
    )
    parser.add_argument("--out", type=Path, required=True, help="the picture (.png)")
    parser.add_argument(
        "--arms",
        type=lambda v: v.split(","),
        default=None,
        help="comma-separated arms to show (default: every paired one)",
    )
    parser.add_argument("--title", default="on-policy arms against plain SFT given the same seconds")
    args = parser.parse_args(argv)
    summaries = {}
    for item in args.summary:
        label, sep, path = item.rpartition("=")  # a label may hold "=" (m=2), a path not
        if not sep or not Path(path).is_file():
            parser.error(f"--summary {item!r}: give LABEL=PATH of an existing ab.jsonl")
        summaries[label] = Path(path)
    rows = sweep_rows(summaries, args.arms)
    plot(rows, args.out, args.title)
    print(markdown(rows))
    print(f"[ab_sweep] {args.out}")


if __name__ == "__main__":
    main()

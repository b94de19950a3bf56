"""``--from-runs``: the summary and figures of run folders as they are (copied back, or cut off)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from _ab.order import read_order
from _ab.plots import plot, plot_grpo
from _ab.run_folder import eval_curve, with_seconds
from _ab.summary import summarize
from _ab.tables import ARMS, CANONICAL, GRPO_ARMS


def summarize_copied_runs(
    task: str,
    out: Path,
    steps: int,
    at_step: int | None,
    arms: Sequence[str] | None = None,
    canonical_steps: int | None = None,
) -> int:
    """``--from-runs``: the summary, ``ab.png`` and ``grpo.png`` of the run folders ``<arm>-s<seed>-<steps>``
    in ``out`` as they are — runs copied back from another host (their ``run.yaml`` names that host's paths,
    so they are not checked against this invocation's config) or cut off by a time limit. ``at_step`` (the
    learner's step; a GRPO or ``sft-canonical`` arm's steps count from its base checkpoint) cuts every curve
    there and leaves out the runs that did not evaluate there, so that a comparison of equal samples covers
    every seed that got that far; ``arms`` keeps those arms only (default: every arm found). A seed's runs
    must start from one base (the same first held-out F1 in every arm), else the pairing would compare
    different bases: that is an error naming the runs. Writes ``ab.jsonl`` (``ab_at<step>.jsonl`` /
    ``ab_at<step>.png`` with ``at_step``); a run's training seconds count from its first evaluation. The
    ``sft-canonical`` runs are the folders of ``canonical_steps`` (default ``steps``).
    """
    curves: dict[tuple[str, int], list[dict[str, float]]] = {}
    units: dict[tuple[str, int], str] = {}
    orders: dict[tuple[str, int], dict[str, Any]] = {}
    grpo_runs: dict[tuple[str, int], Path] = {}
    canonical_steps = canonical_steps or steps
    folders = [(d, steps) for d in sorted(out.glob(f"*-s*-{steps}")) if not d.name.startswith(CANONICAL)]
    folders += [(d, canonical_steps) for d in sorted(out.glob(f"{CANONICAL}-s*-{canonical_steps}"))]
    for run_dir, run_steps in folders:
        arm, _, seed = run_dir.name.removesuffix(f"-{run_steps}").rpartition("-s")
        metrics = run_dir / "metrics.jsonl"
        known = arm in ARMS or arm in GRPO_ARMS or arm == CANONICAL
        if not known or not seed.isdigit() or not metrics.exists():
            continue
        if arms is not None and arm not in arms:
            continue
        curve = [p for p in eval_curve(metrics) if at_step is None or p["step"] <= at_step]
        if not curve or (at_step is not None and curve[-1]["step"] != at_step):
            print(f"[ab] {run_dir.name}: no evaluation at step {at_step}, left out", flush=True)
            continue
        # training seconds from the first evaluation (the base) on
        curves[(arm, int(seed))], units[(arm, int(seed))] = with_seconds(curve, run_dir, curve[0]["step"])
        if arm == CANONICAL and read_order(run_dir) is not None:
            ordering = yaml.safe_load((run_dir / "run.yaml").read_text())["data"]["object_ordering"]
            orders[(arm, int(seed))] = {**read_order(run_dir), "ordering": ordering}  # type: ignore[dict-item]
        if arm in GRPO_ARMS:
            grpo_runs[(arm, int(seed))] = run_dir
    if not curves:
        raise SystemExit(f"no run folders *-s<seed>-{steps} with evaluations in {out}")
    for seed in sorted({s for _, s in curves}):
        starts = {arm: c[0]["f1"] for (arm, s), c in curves.items() if s == seed}
        if len(set(starts.values())) > 1:
            raise SystemExit(
                f"seed {seed}: the runs in {out} start from different bases (first held-out F1 by arm: "
                f"{starts}); pass --arms of one base, or move the other runs out of the folder"
            )
    suffix = "" if at_step is None else f"_at{at_step}"
    with (out / f"ab{suffix}.jsonl").open("w") as fh:
        for (arm, seed), curve in sorted(curves.items()):
            for point in curve:
                fh.write(json.dumps({"task": task, "arm": arm, "seed": seed, **point}) + "\n")
        for line in summarize(task, curves, units=units, orders=orders):
            fh.write(json.dumps({"summary": True, **line}) + "\n")
            print(json.dumps(line), flush=True)
    plot(task, curves, out / f"ab{suffix}.png")
    if grpo_runs:
        plot_grpo(grpo_runs, out / "grpo.png")
    print(f"[ab] {out / f'ab{suffix}.jsonl'} and {out / f'ab{suffix}.png'}", flush=True)
    return 0

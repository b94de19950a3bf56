"""``--from-runs``: the summary and figures of run folders as they are (copied back, or cut off)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from _ab.canonical_budget import read_budget
from _ab.order import read_order
from _ab.plots import plot, plot_grpo
from _ab.run_folder import base_steps_of, last_step, recipe_curve
from _ab.step_prices import arm_prices, priced
from _ab.summary import summarize
from _ab.tables import ARMS, CANONICAL, GRPO_ARMS


def summarize_copied_runs(
    task: str,
    out: Path,
    steps: int,
    at_step: int | None,
    arms: Sequence[str] | None = None,
    canonical_steps: int | None = None,
    price_seed: int | None = None,
) -> int:
    """``--from-runs``: the summary, ``ab.png`` and ``grpo.png`` of the run folders ``<arm>-s<seed>-<steps>``
    in ``out`` as they are — runs copied back from another host (their ``run.yaml`` names that host's paths,
    so they are not checked against this invocation's config) or cut off by a time limit. ``at_step`` (the
    learner's step; a GRPO arm's steps count from its base checkpoint) cuts every curve
    there and leaves out the runs that did not evaluate there, so that a comparison of equal samples covers
    every seed that got that far; ``arms`` keeps those arms only (default: every arm found). A seed's runs
    must start from one base (the same first held-out F1 in every arm), else the pairing would compare
    different bases: that is an error naming the runs. Writes ``ab.jsonl`` (``ab_at<step>.jsonl`` /
    ``ab_at<step>.png`` with ``at_step``); every curve starts at the seed's base
    (`_ab.run_folder.recipe_curve`: the base steps a supervised arm trained itself are neither counted nor
    timed; a GRPO run's steps are moved onto the others' by the seed's base steps). The
    ``sft-canonical`` runs are :func:`canonical_folders`'s. With ``price_seed`` the runs of every other seed
    are read at their arm's price (`_ab.step_prices`: they ran side by side, the pricing seed's alone).
    Without ``at_step``, a run that stopped before its last step (:func:`last_step`) is left out (said),
    never read as a shorter run.
    """
    curves: dict[tuple[str, int], list[dict[str, float]]] = {}
    units: dict[tuple[str, int], str] = {}
    orders: dict[tuple[str, int], dict[str, Any]] = {}
    grpo_runs: dict[tuple[str, int], Path] = {}
    budgets: dict[int, dict[str, Any]] = {}
    bases: dict[int, int] = {}  # seed → its supervised runs' shared base steps
    folders = [(d, steps) for d in sorted(out.glob(f"*-s*-{steps}")) if not d.name.startswith(CANONICAL)]
    folders += canonical_folders(out, canonical_steps)
    for run_dir, run_steps in folders:
        arm, _, seed = run_dir.name.removesuffix(f"-{run_steps}").rpartition("-s")
        metrics = run_dir / "metrics.jsonl"
        known = arm in ARMS or arm in GRPO_ARMS or arm == CANONICAL
        if not known or not seed.isdigit() or not metrics.exists():
            continue
        if arms is not None and arm not in arms:
            continue
        # from the base's evaluation on, with the seconds of the recipe's steps only
        base = base_steps_of(run_dir, run_steps)
        curve, unit = recipe_curve(run_dir, base)
        curve = [p for p in curve if at_step is None or p["step"] <= at_step]
        if not curve or (at_step is not None and curve[-1]["step"] != at_step):
            print(f"[ab] {run_dir.name}: no evaluation at step {at_step}, left out", flush=True)
            continue
        last = last_step(run_dir, run_steps)
        if at_step is None and curve[-1]["step"] < last:
            print(f"[ab] {run_dir.name}: stopped at step {curve[-1]['step']} of {last}, left out", flush=True)
            continue
        curves[(arm, int(seed))], units[(arm, int(seed))] = curve, unit
        bases[int(seed)] = max(bases.get(int(seed), 0), base)
        if arm == CANONICAL and read_order(run_dir) is not None:
            ordering = yaml.safe_load((run_dir / "run.yaml").read_text())["data"]["object_ordering"]
            orders[(arm, int(seed))] = {**read_order(run_dir), "ordering": ordering}  # type: ignore[dict-item]
        if arm in GRPO_ARMS:
            grpo_runs[(arm, int(seed))] = run_dir
        if arm == CANONICAL and read_budget(run_dir) is not None:
            budgets[int(seed)] = read_budget(run_dir)  # type: ignore[assignment]
    if not curves:
        raise SystemExit(f"no run folders *-s<seed>-{steps} with evaluations in {out}")
    for (arm, seed), curve in curves.items():  # a GRPO run counts from its base: onto the others' steps
        if arm in GRPO_ARMS and bases.get(seed):
            curves[(arm, seed)] = [{**p, "step": p["step"] + bases[seed]} for p in curve]
    if price_seed is not None:  # the other seeds ran side by side: their steps at the pricing seed's prices
        prices = arm_prices(out, price_seed, steps, sorted({arm for arm, _ in curves}))
        for (arm, seed), curve in curves.items():
            if seed != price_seed:
                curves[(arm, seed)] = priced(curve, prices["seconds_per_step"][arm])
        print(f"[ab] step prices from seed {price_seed}: {json.dumps(prices)}", flush=True)
    for seed, grpo in sorted({(s, arm in GRPO_ARMS) for arm, s in curves}):
        # a GRPO run evaluates through its own engine (the harness's GRPO arms colocate HF; the others may
        # roll out on vLLM): its base F1 may differ by the engines' numerics, so each group is checked alone
        starts = {
            arm: c[0]["f1"] for (arm, s), c in curves.items() if s == seed and (arm in GRPO_ARMS) == grpo
        }
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
        for line in summarize(task, curves, units=units, orders=orders, budgets=budgets):
            fh.write(json.dumps({"summary": True, **line}) + "\n")
            print(json.dumps(line), flush=True)
    plot(task, curves, out / f"ab{suffix}.png", units)
    if grpo_runs:
        plot_grpo(grpo_runs, out / "grpo.png")
    print(f"[ab] {out / f'ab{suffix}.jsonl'} and {out / f'ab{suffix}.png'}", flush=True)
    return 0


def canonical_folders(out: Path, canonical_steps: int | None) -> list[tuple[Path, int]]:
    """The ``sft-canonical`` run folders in ``out`` with their steps: those of ``canonical_steps`` when given,
    else one per seed whatever its steps (sized by seconds, they differ by seed); of several for a seed, the
    one stamped with its budget (`_ab.canonical_budget`; of a control run again longer, its last top-up),
    else it is an error naming them."""
    if canonical_steps is not None:
        return [(d, canonical_steps) for d in sorted(out.glob(f"{CANONICAL}-s*-{canonical_steps}"))]
    by_seed: dict[str, list[tuple[Path, int]]] = {}
    for run_dir in sorted(out.glob(f"{CANONICAL}-s*-*")):
        seed, _, run_steps = run_dir.name.removeprefix(f"{CANONICAL}-s").partition("-")
        if seed.isdigit() and run_steps.isdigit():
            by_seed.setdefault(seed, []).append((run_dir, int(run_steps)))
    chosen = []
    for seed, found in sorted(by_seed.items()):
        stamped = [f for f in found if read_budget(f[0]) is not None]
        topped = [f for f in stamped if "topped_up_from" in (read_budget(f[0]) or {})]
        if topped:  # a short control was run again, longer: the last top-up is the control
            stamped = [max(topped, key=lambda f: read_budget(f[0])["top_up"])]  # type: ignore[index]
        if len(found) > 1 and len(stamped) != 1:
            names = [d.name for d, _ in found]
            raise SystemExit(f"seed {seed}: several {CANONICAL} runs {names}; pass --canonical-steps")
        chosen.append(stamped[0] if len(found) > 1 else found[0])
    return chosen

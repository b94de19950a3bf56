"""Seconds of runs that shared a GPU, priced at what each step costs alone.

Runs side by side on one GPU slow each other down unevenly (a rollout's latency-bound decode suffers more
from time-slicing than a plain step), so their wall seconds are not the GPU-seconds a user pays. With
``--price-seed S`` the harness runs seed ``S``'s arms alone first and measures, per arm, its seconds per
training step (`arm_prices`); every run's curve then carries ``seconds = (steps after the base) x that
arm's price`` (`priced`), and ``sft-canonical`` is sized and paired on those seconds. ``sft-canonical`` is
priced at the ``sft`` run's step (the same plain-GT step). The wall seconds each run took beside the others
stay in its ``metrics.jsonl``; ``contention`` says how much slower they were than the price.

Invariant: a priced curve's seconds are 0 at its first evaluation (the base) and grow linearly in steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _ab.canonical_budget import size_canonical
from _ab.run_folder import base_steps_of, recipe_curve
from _ab.tables import CANONICAL, CONTROLS

PRICES_STAMP = "step_prices.json"
"""File in the A/B's folder: the per-arm seconds per step measured on the pricing seed's runs alone."""


def seconds_per_step(curve: list[dict[str, float]]) -> float | None:
    """A run's training seconds per step from its curve (``seconds`` at its last evaluation over the steps
    since its first); None when it trained no step or has no seconds."""
    if len(curve) < 2 or "seconds" not in curve[-1]:
        return None
    steps = curve[-1]["step"] - curve[0]["step"]
    return curve[-1]["seconds"] / steps if steps > 0 else None


def arm_prices(out: Path, seed: int, steps: int, arms: list[str]) -> dict[str, Any]:
    """Seconds per step of each arm in ``arms`` on seed ``seed``'s finished runs in ``out`` (their folders
    ``<arm>-s<seed>-<steps>``; ``sft-canonical`` takes ``sft``'s), with the unit, as ``{"seed", "unit",
    "seconds_per_step": {arm: s}}``.

    Raises:
        SystemExit: a run of the pricing seed is missing or trained no step (names the folder and the fix).
    """
    prices: dict[str, float] = {}
    units: set[str] = set()
    for arm in [a for a in arms if a != CANONICAL]:
        run_dir = out / f"{arm}-s{seed}-{steps}"
        price, unit = None, None
        if (run_dir / "metrics.jsonl").exists():  # its recipe's steps: a base it trained is not its price
            curve, unit = recipe_curve(run_dir, base_steps_of(run_dir, steps))
            price = seconds_per_step(curve)
        if price is None or unit is None:
            raise SystemExit(
                f"--price-seed {seed}: {run_dir} holds no finished run to price {arm}'s step; run that seed's"
                f" arms alone first (bench/ab_learning.py --seeds {seed} --price-seed {seed}"
                f" --arms {','.join(arms)})"
            )
        prices[arm] = price
        units.add(unit)
    if CANONICAL in arms:
        if "sft" not in prices:
            raise SystemExit(
                f"--price-seed {seed}: {CANONICAL} is priced at the sft run's step; add the sft arm"
            )
        prices[CANONICAL] = prices["sft"]
    if len(units) > 1:
        raise SystemExit(f"--price-seed {seed}: its runs were timed in different units {sorted(units)}")
    return {"seed": seed, "unit": units.pop() if units else None, "seconds_per_step": prices}


def write_prices(out: Path, prices: dict[str, Any]) -> None:
    """Stamps the A/B folder with the prices (read back by ``--from-runs``)."""
    (out / PRICES_STAMP).write_text(json.dumps(prices) + "\n")


def read_prices(out: Path) -> dict[str, Any] | None:
    """The prices :func:`write_prices` left in ``out`` (None: the runs were not priced)."""
    path = out / PRICES_STAMP
    return json.loads(path.read_text()) if path.exists() else None


def stamped_prices(out: Path, seed: int, arms: list[str]) -> dict[str, Any]:
    """The prices the pricing seed's own invocation stamped in ``out`` (every arm it ran, so that a control
    launched on its own is sized by the on-policy arms' prices). ``sft-canonical`` is priced wherever ``sft``
    is (the same plain-GT step), whether or not the pricing seed's invocation ran it.

    Raises:
        SystemExit: no stamp from ``seed``, or an arm of ``arms`` it did not price (names the fix).
    """
    prices = read_prices(out)
    if prices is None or prices.get("seed") != seed:
        raise SystemExit(
            f"--price-seed {seed}: {out / PRICES_STAMP} holds no prices from seed {seed}; run its arms"
            f" alone first (bench/ab_learning.py --seeds {seed} --price-seed {seed} --arms ...)"
        )
    priced_arms = set(prices["seconds_per_step"])
    if "sft" in priced_arms:  # the control's step is the sft step (`arm_prices`), stamped or not
        priced_arms.add(CANONICAL)
    missing = sorted(set(arms) - priced_arms)
    if missing:
        raise SystemExit(
            f"--price-seed {seed}: arms {missing} were not run on seed {seed}; run them there first"
        )
    return prices


def priced_budget(prices: dict[str, Any], steps: int) -> dict[str, Any]:
    """``sft-canonical``'s steps from the prices alone: the slowest priced on-policy arm's ``steps`` at its
    price, over the sft step's price (`_ab.canonical_budget.size_canonical`). Priced seconds are steps x
    price, so this is the budget the seed's own priced runs give, known before they run: a control can run
    beside its seed's arms."""
    per_step = prices["seconds_per_step"]
    arms = {arm: steps * price for arm, price in per_step.items() if arm not in CONTROLS}
    sft = per_step.get("sft")
    return size_canonical(arms, None if sft is None else steps * sft, steps, steps, prices.get("unit"))


def priced(curve: list[dict[str, float]], price: float) -> list[dict[str, float]]:
    """``curve`` with ``seconds`` = steps since its first evaluation x ``price``, and the measured seconds
    kept as ``wall_seconds``."""
    first = curve[0]["step"] if curve else 0
    return [
        {**p, "seconds": round((p["step"] - first) * price, 3), "wall_seconds": p.get("seconds", 0.0)}
        for p in curve
    ]


def contention(curve: list[dict[str, float]]) -> float | None:
    """How much slower a priced run was than its price: its measured seconds ÷ its priced seconds at the
    last evaluation (None before any step)."""
    if not curve or not curve[-1].get("seconds"):
        return None
    return curve[-1].get("wall_seconds", curve[-1]["seconds"]) / curve[-1]["seconds"]

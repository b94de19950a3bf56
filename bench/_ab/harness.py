"""One A/B invocation: the task's data and base, then every (seed, arm) run in turn — reused when finished,
else trained — its evaluations appended to ``ab.jsonl``, then the summary lines and the figures."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from launcher_utils import exit_on_signals

from _ab.canonical_budget import budget_for_seed, top_up, write_budget
from _ab.gpus import held_gpus, server_gpus, visible_gpus
from _ab.order import ORDER_DIR, canonical_ordering, measure_base_order, read_order
from _ab.plots import plot, plot_grpo
from _ab.prepare import base_fingerprint, build_data, build_model
from _ab.processes import SHM_DIR, run_learner, start_server
from _ab.run_configs import (
    base_model,
    canonical_run_config,
    common_config,
    grpo_rollout,
    grpo_run_config,
    run_rollout,
    samples_per_step,
    stage2_run_config,
)
from _ab.run_folder import BASE_STAMP, DEVICE_STAMP, finished, recipe_curve
from _ab.step_prices import arm_prices, contention, priced, priced_budget, stamped_prices, write_prices
from _ab.summary import summarize
from _ab.tables import ARMS, CANONICAL, GRPO_ARMS, REPO, TASKS, grpo_override, reuses_rollouts

Key = tuple[str, int]
"""(arm, seed) of one run."""


def run_ab(args: argparse.Namespace, arms: list[str]) -> int:
    """Runs ``arms`` (in order) for every seed of ``args`` (the command line's), then summarizes and plots.

    The arms that resume the seed's base (`_ab.tables.resumes_base`) start from the ``sft`` run's checkpoint
    at the base steps: every ``sft`` run saves it, whichever invocation runs it, so an arm launched later
    (``bench/equal_seconds_ab_gpu.sh``'s chains) finds it and the sft run is one run in every invocation.
    ``sft-canonical`` runs after the seed's other arms: without ``--canonical-steps`` its steps are sized
    from their seconds (`_ab.canonical_budget`)."""
    task = TASKS[args.task]
    out = (args.out or REPO / "runs" / "ab" / args.task).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = build_data(task, out / "data", args.eval_samples, args.smoke)
    stage1 = {"steps": args.stage1_steps, "every": args.stage1_every, "target_f1": args.stage1_target_f1}
    stage1 |= {"device": args.stage1_device, "eval_from": args.stage1_eval_from}
    if args.smoke:  # a throw-away stage-1 of its own, never the cached real one
        stage1 |= {"n_eval": 2, "max_new_tokens": 32, "batch": 2}
        task = {**task, "model": task["model"] + "-smoke"}
    build_model(task, out / "data", stage1)
    if args.prepare_only:
        return 0
    base_sha = base_fingerprint(task)
    task_config = REPO / task["config"]
    common = common_config(task, train, held_out, eval_samples=args.eval_samples, smoke=args.smoke)

    server = None
    url = args.server_url
    exit_on_signals()  # SIGTERM / SIGINT unwind through the `finally` that stops the server started here
    if url is None and not args.colocate:
        server, url = start_server(task_config, Path(task["model"]), out)
    shm_dir = SHM_DIR if server is not None else None
    rollout = run_rollout(args, url, shm_dir)
    curves: dict[Key, list[dict[str, float]]] = {}
    units: dict[Key, str] = {}
    samples: dict[Key, int] = {}
    orders: dict[Key, dict[str, Any]] = {}
    budgets: dict[int, dict[str, Any]] = {}
    visible = visible_gpus()
    gpus = held_gpus(visible, server_gpus(out / "server.yaml", visible) if server is not None else None)
    results = out / "ab.jsonl"
    seeds = [int(s) for s in args.seeds.split(",")]
    prices = None  # --price-seed: each arm's seconds per step measured on that seed's runs alone
    if args.price_seed is not None and args.price_seed not in seeds:  # stamped by that seed's invocation
        prices = stamped_prices(out, args.price_seed, arms)
    try:
        with results.open("a") as fh:
            for seed in seeds:
                # the seed's base: the sft run's weights at the base steps (saved for them), else the task's
                base_dir = out / f"sft-s{seed}-{args.steps}" / f"checkpoint-{args.base_steps}"
                base = str(base_dir) if args.base_steps > 0 else None
                queue, top_ups = list(arms), {}  # a control short of the arm's seconds runs again, longer
                short_run: Path | None = None  # the short control: the longer one reuses its base order
                while queue:
                    arm = queue.pop(0)
                    steps = args.steps
                    if arm == CANONICAL:  # sized by the seed's arms' seconds (priced: known before they ran)
                        if seed in top_ups:
                            budgets[seed] = top_ups.pop(seed)
                        elif prices is not None and args.canonical_steps is None:
                            budgets[seed] = priced_budget(prices, args.steps)
                        else:
                            budgets[seed] = budget_for_seed(
                                curves, units, seed, args.steps, args.canonical_steps
                            )
                        steps = budgets[seed]["steps"]
                        print(
                            f"[ab] {args.task} seed {seed}: {CANONICAL} {json.dumps(budgets[seed])}",
                            flush=True,
                        )
                    run_dir = out / f"{arm}-s{seed}-{steps}"
                    metrics = run_dir / "metrics.jsonl"
                    if arm == CANONICAL and short_run is not None and read_order(run_dir) is None:
                        # the same base, rows and seed: its order measurement is this run's too
                        shutil.copytree(short_run / ORDER_DIR, run_dir / ORDER_DIR, dirs_exist_ok=True)
                    # a run from the base counts its own steps; the curve is shifted onto the others' steps
                    # (sft-canonical resumes the sft run's base checkpoint: its steps go on from the base's)
                    own_steps = arm in GRPO_ARMS or (arm == CANONICAL and base is None)
                    total = steps if own_steps else args.base_steps + steps
                    if arm in GRPO_ARMS:
                        cfg = grpo_run_config(
                            task_config,
                            common,
                            grpo=grpo_override(arm),
                            model=base or base_model(task_config, common),
                            run_dir=run_dir,
                            seed=seed,
                            steps=args.steps,
                            eval_every=args.eval_every,
                            learning_rate=GRPO_ARMS[arm].get("learning_rate", args.grpo_learning_rate),
                            rollout=grpo_rollout(args),
                        )
                    elif arm == CANONICAL:
                        canonical = {"model": base, "run_dir": run_dir, "seed": seed, "steps": steps}
                        canonical |= {"eval_every": args.eval_every, "learning_rate": args.learning_rate}
                        canonical["base_steps"] = args.base_steps
                        ordering = canonical_ordering(read_order(run_dir), task["ordering"])
                        cfg = canonical_run_config(common, rollout, ordering=ordering, **canonical)
                    else:
                        cfg = stage2_run_config(
                            common,
                            rollout,
                            ARMS[arm],
                            sft=arm == "sft",
                            run_dir=run_dir,
                            seed=seed,
                            base_steps=args.base_steps,
                            steps=args.steps,
                            eval_every=args.eval_every,
                            learning_rate=args.learning_rate,
                            saves_base=True,
                            base=base if reuses_rollouts(arm) else None,
                        )
                    if not finished(run_dir, cfg, total, base_sha) or (
                        arm == CANONICAL and read_order(run_dir) is None
                    ):
                        if args.summarize_only:
                            print(f"[ab] {run_dir.name}: not finished, left out", flush=True)
                            continue
                        t0 = time.time()
                        metrics.unlink(missing_ok=True)
                        if arm == CANONICAL:
                            order = read_order(run_dir) if short_run is not None else None
                            order = order or measure_base_order(
                                common,
                                model=base or base_model(task_config, common),
                                train=train,
                                run_dir=run_dir,
                                seed=seed,
                                n_items=args.order_samples,
                            )
                            print(
                                f"[ab] {args.task} seed {seed}: the base's order {json.dumps(order)}",
                                flush=True,
                            )
                            ordering = canonical_ordering(order, task["ordering"])
                            cfg = canonical_run_config(common, rollout, ordering=ordering, **canonical)
                        if arm == CANONICAL:
                            write_budget(run_dir, budgets[seed])
                        run_learner(cfg, run_dir / "run.yaml", run_dir / "learner.log")
                        (run_dir / BASE_STAMP).write_text(base_sha + "\n")
                        (run_dir / DEVICE_STAMP).write_text(json.dumps({"gpus": gpus}) + "\n")
                        print(f"[ab] {args.task} {arm} seed {seed}: {time.time() - t0:.0f} s", flush=True)
                    # from the base on; a run that counts its own steps is moved onto the others' steps
                    curve, units[(arm, seed)] = recipe_curve(run_dir, 0 if own_steps else args.base_steps)
                    if own_steps:
                        curve = [{**p, "step": p["step"] + args.base_steps} for p in curve]
                    if prices is not None:  # ran beside others: its steps at the arm's price, not its wall
                        curve = priced(curve, prices["seconds_per_step"][arm])
                        print(f"[ab] {run_dir.name}: wall ÷ priced seconds {contention(curve)}", flush=True)
                    longer = (
                        top_up(budgets[seed], curve, steps) if arm == CANONICAL and prices is None else None
                    )
                    if longer is not None:  # trained fewer seconds than the arm: sized again at its own pace
                        print(f"[ab] {args.task} seed {seed}: {CANONICAL} {longer['reason']}", flush=True)
                        top_ups[seed], short_run = longer, run_dir
                        queue.insert(0, CANONICAL)
                        continue
                    if arm == CANONICAL:  # the order measured and the annotation order it trained on
                        orders[(arm, seed)] = {
                            **(read_order(run_dir) or {}),
                            "ordering": cfg["data"]["object_ordering"],
                        }
                    samples[(arm, seed)] = steps * samples_per_step(cfg)
                    curves[(arm, seed)] = curve
                    for point in curve:
                        fh.write(json.dumps({"task": args.task, "arm": arm, "seed": seed, **point}) + "\n")
                        fh.flush()
                if seed == args.price_seed:  # its runs ran alone: they price every later seed's steps
                    prices = arm_prices(out, seed, args.steps, arms)
                    write_prices(out, prices)
                    print(f"[ab] step prices from seed {seed}: {json.dumps(prices)}", flush=True)
            summary = summarize(args.task, curves, samples, units, orders, budgets)
            for line in summary:
                fh.write(json.dumps({"summary": True, **line}) + "\n")
                print(json.dumps(line), flush=True)
    finally:
        if server is not None:
            server.stop()
    plot(args.task, curves, out / "ab.png", units)
    grpo_runs = {(arm, seed): out / f"{arm}-s{seed}-{args.steps}" for arm, seed in curves if arm in GRPO_ARMS}
    if grpo_runs:
        plot_grpo(grpo_runs, out / "grpo.png")
    print(f"[ab] {results} and {out / 'ab.png'}", flush=True)
    return 0

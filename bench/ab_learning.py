"""A/B of learning recipes: K seeds x arms, equal steps and samples, held-out F1 over seeds.

    python bench/ab_learning.py --task text-random --arms sft,rm-keep,rm-drop,rm-reorder --seeds 0,1,2
    python bench/ab_learning.py --task image-random --colocate  # a GPU machine without vLLM
    python bench/ab_learning.py --task crowded-random --colocate --base-steps 0 --arms sft,sft-canonical
    python bench/ab_learning.py --smoke --server-url URL        # the CI smoke (< 1 min on a running server)

A task is a demo config plus its object order (``TASKS``: text or image demo, ``sorted`` or ``random``). Every
run of a seed starts with the same ``--base-steps`` of plain-GT training (the demo's own stage 1: runs are
deterministic, so this phase is one checkpoint shared by the seed's arms, optimizer state included), then
trains ``--steps`` more with its arm's recipe (``ARMS``: a ``stage2`` override, exactly what a user writes
in YAML). ``sft`` is the weak control: plain GT for the same steps and samples, in the task's order. The
strong control is ``sft-canonical`` (``CANONICAL``): plain GT from the same base for the same steps, listed
in the order the base itself follows, measured before it trains on the base's greedy rollouts of
``--order-samples`` training rows (``python -m learner.evaluate``'s ``object_order``,
`learner.evaluate.order`: the share of pairs of matched predictions each known order ranks as the model
emitted them), so an on-policy arm has to beat more than the fix of the order. The held-out F1 is evaluated
every ``--eval-every`` steps on ``--eval-samples`` rows (greedy; 64 rows move F1 by about +-0.05 between
equivalent runs, so 256 and three seeds are the minimum for a 0.03 claim).

GRPO arms (``GRPO_ARMS``, ``--colocate`` only: e.g. ``grpo-detection``, GRPO with ``grpo.reward_preset:
detection``) start from the same base: the sft run of the seed saves its weights at ``--base-steps``
(``checkpoint-<base>``, the plain-GT phase every arm shares; with ``--base-steps 0`` the task's model), and
GRPO trains ``--steps`` steps from there (``learner.grpo``, rollouts by the HF engine in-process; constant
``--grpo-learning-rate``, a fresh optimizer), evaluated by the rollout-matching evaluator on the same held-out
rows with the same greedy decoding (``learner.grpo.evaluation``); its steps are shifted by the base steps in
``ab.jsonl``. ``sft-canonical`` resumes that checkpoint instead (optimizer, schedule and data position of the
sft run: in the task's own order it is the sft run; its annotation order is not the shared phase's; with
``--base-steps 0`` it starts from the task's model with a fresh optimizer); ``--canonical-steps`` lets it
train longer than ``--steps`` (an on-policy arm's step costs more: the control then gets the arm's seconds,
and by samples it is read at the arm's last step). Trained samples: a plain-GT or
rollout-matching step trains ``per_device_train_batch_size x gradient_accumulation_steps`` samples; a GRPO
step trains ``prompts x num_generations`` completions, and the arm uses ``(that batch) / GRPO_GENERATIONS``
prompts per step, so every arm trains the same number of samples per step (``trained_samples`` in the
summary counts the steps after the base). Training seconds: each evaluation carries ``seconds``, the wall
seconds the run spent in its steps after the base (evaluations excluded; ``step_seconds``), times the GPUs
the run held on a GPU host (GPU-seconds: the learner's, plus the rollout server's when the harness started
it) — ``train_seconds`` and ``seconds_unit`` per run in the summary (``gpu``, or ``cpu`` wall seconds).

Writes ``runs/ab/<task>/ab.jsonl`` (one line per evaluation; then per arm: the final F1 per seed, mean, sd and
the PAIRED difference to each control of the same seed — ``paired_*`` to ``sft``, ``canonical_paired_*`` to
``sft-canonical`` — at equal trained samples and, ``*_at_seconds_*``, at equal training seconds; the
``sft-canonical`` line holds the base order measured per seed), ``ab.png`` (F1, precision, recall, F1 at
maskIoU 0.5, duplicates and predicted ÷ GT by step, and F1 by training seconds: mean line and min-max band per
arm, the controls dashed, each arm's paired mean against both controls in the legend) and, with a GRPO
arm, ``grpo.png`` (reward, KL, completion length per step). One rollout server (the task config's
``server:`` section) serves every run unless ``--server-url`` names one or ``--colocate`` rolls out
in-process; a run's first rollout step syncs its weights, so runs can share a server. Finished runs are reused
(delete the run directory to redo one).

This file is the command line; the parts live in ``bench/_ab/``, one module per concern (its ``__init__``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ab.from_runs import summarize_copied_runs  # noqa: E402
from _ab.harness import run_ab  # noqa: E402
from _ab.tables import ARMS, CANONICAL, GRPO_ARMS, REPO, TASKS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="text-random")
    parser.add_argument("--arms", default=None, help="default sft,rm-keep,rm-drop (--smoke: sft,rm-reorder)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--base-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--canonical-steps",
        type=int,
        default=None,
        help=f"{CANONICAL}: steps it trains (default --steps; more gives it the on-policy arms' seconds)",
    )
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-samples", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=None, help="constant; default: the config's")
    parser.add_argument("--grpo-learning-rate", type=float, default=1e-4, help="GRPO arms (constant)")
    parser.add_argument("--out", type=Path, default=None, help="default runs/ab/<task>")
    parser.add_argument("--server-url", default=None, help="use this running server instead of starting one")
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="roll out in-process instead of a server (one GPU: the engine of --colocate-backend)",
    )
    backends = ["auto", "vllm", "hf"]
    backend_help = "--colocate's engine (vLLM, or the HF fallback); auto: vllm with CUDA and vLLM, else hf"
    parser.add_argument("--colocate-backend", choices=backends, default="auto", help=backend_help)
    parser.add_argument("--smoke", action="store_true", help="tiny run for CI: 2 steps, 8 eval rows")
    parser.add_argument(
        "--order-samples",
        type=int,
        default=64,
        help=f"{CANONICAL}: training rows the base's object order is measured on (its greedy rollouts)",
    )
    parser.add_argument("--stage1-steps", type=int, default=1400, help="crowded tasks: stage-1 steps")
    parser.add_argument("--stage1-every", type=int, default=200, help="crowded: stage-1 eval/snapshot period")
    parser.add_argument(
        "--stage1-eval-from", type=int, default=0, help="crowded: first stage-1 step evaluated (saves time)"
    )
    parser.add_argument("--stage1-target-f1", type=float, default=0.5, help="crowded: the base's F1")
    parser.add_argument("--stage1-device", default="cuda", help="crowded: where stage-1 trains")
    parser.add_argument(
        "--summarize-only",
        action="store_true",
        help="train nothing: summarize the runs that finished (e.g. after parallel runs were cut off)",
    )
    parser.add_argument(
        "--prepare-only", action="store_true", help="build the data and the base model, then stop"
    )
    parser.add_argument(
        "--from-runs",
        action="store_true",
        help="train and build nothing: summarize the run folders in --out as they are (e.g. copied back)",
    )
    parser.add_argument(
        "--at-step",
        type=int,
        default=None,
        help="with --from-runs: compare the arms at this step (runs without an evaluation there left out)",
    )
    args = parser.parse_args(argv)
    if args.at_step is not None and not args.from_runs:
        parser.error("--at-step goes with --from-runs")
    if args.from_runs:
        out = (args.out or REPO / "runs" / "ab" / args.task).resolve()
        arms = args.arms.split(",") if args.arms else None
        return summarize_copied_runs(args.task, out, args.steps, args.at_step, arms, args.canonical_steps)
    if args.smoke:
        args.seeds, args.base_steps, args.steps = "0", 2, 2
        args.eval_every, args.eval_samples = 2, 8
        args.arms = args.arms or "sft,rm-reorder"
    args.arms = args.arms or "sft,rm-keep,rm-drop"
    unknown = sorted(set(args.arms.split(",")) - set(ARMS) - set(GRPO_ARMS) - {CANONICAL})
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; known: {sorted([*ARMS, *GRPO_ARMS, CANONICAL])}")
    args.canonical_steps = args.canonical_steps or args.steps
    if args.canonical_steps % args.eval_every or args.steps % args.eval_every:
        parser.error(
            f"--steps {args.steps} and --canonical-steps {args.canonical_steps} must be multiples of"
            f" --eval-every {args.eval_every} (the controls are read at the arms' last step)"
        )
    if args.order_samples < 1:
        parser.error(f"--order-samples {args.order_samples} must be >= 1")
    arms = args.arms.split(",")
    grpo_arms = [a for a in arms if a in GRPO_ARMS]
    if grpo_arms and not args.colocate:
        parser.error(
            f"{grpo_arms} run with --colocate only (GRPO rolls out with its own HF engine in-process)"
        )
    from_base = [a for a in arms if a in GRPO_ARMS or a == CANONICAL]  # start from the seed's base checkpoint
    if from_base and args.base_steps > 0:  # the sft run is their base checkpoint: it runs first
        arms = ["sft", *[a for a in arms if a != "sft"]]
    return run_ab(args, arms, saves_base=bool(from_base))


if __name__ == "__main__":
    sys.exit(main())

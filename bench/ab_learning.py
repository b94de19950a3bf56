"""A/B of learning recipes: K seeds x arms, at equal samples and equal training seconds, held-out F1.

    python bench/ab_learning.py --task text-random --arms sft,rm-keep,rm-drop,rm-reorder --seeds 0,1,2
    python bench/ab_learning.py --task image-random --colocate  # a GPU machine without vLLM
    python bench/ab_learning.py --task crowded-random --colocate --base-steps 0 --arms sft,sft-canonical
    python bench/ab_learning.py --smoke --server-url URL        # the CI smoke (< 1 min on a running server)

A task is a demo config plus its object order (``TASKS``: text or image demo, ``sorted`` or ``random``). Every
run of a seed starts with the same ``--base-steps`` of plain-GT training (the demo's own stage 1: runs are
deterministic, so this phase is one checkpoint shared by the seed's arms, optimizer state included), then
trains ``--steps`` more with its arm's recipe (``ARMS``: a ``stage2`` override, exactly what a user writes in
YAML). ``sft`` is the weak control: plain GT for the same steps and samples, in the task's order. The strong
control is ``sft-canonical`` (``CANONICAL``): plain GT from the same base for the on-policy arms' seconds,
listed in the order the base itself follows, measured before it trains on the base's greedy rollouts of
``--order-samples`` training rows (``python -m learner.evaluate``'s ``object_order``,
`learner.evaluate.order`: the share of pairs of matched predictions each known order ranks as the model
emitted them), so an on-policy arm has to beat more than the fix of the order. The held-out F1 is evaluated
every ``--eval-every`` steps on ``--eval-samples`` rows (greedy; 64 rows move F1 by about +-0.05 between
equivalent runs, so 256 and three seeds are the minimum for a 0.03 claim).

GRPO arms (``GRPO_ARMS``, ``--colocate`` only: e.g. ``grpo-detection``, GRPO with ``grpo.reward_preset:
detection``) start from the same base: the sft run of the seed saves its weights at ``--base-steps``
(``checkpoint-<base>``, the plain-GT phase every arm shares; with ``--base-steps 0`` the task's model), and
GRPO trains ``--steps`` steps from there (``learner.grpo``, rollouts by the HF engine in-process, or a
colocated vLLM with ``--grpo-colocate-backend vllm``; constant ``--grpo-learning-rate``, a fresh
optimizer), evaluated by the rollout-matching evaluator on the same held-out
rows with the same greedy decoding (``learner.grpo.evaluation``); its steps are shifted by the base steps in
``ab.jsonl``. ``sft-canonical`` resumes that checkpoint instead (optimizer and data position of the sft run:
in the task's own order and ``--steps`` steps it is the sft run; its annotation order is not the shared
phase's; with ``--base-steps 0`` it starts from the task's model with a fresh optimizer). Its length is a
seconds budget: it runs after the seed's other arms and trains ``ceil(arm seconds / sft seconds per step)``
steps, the arm seconds being the largest ``train_seconds`` of the seed's on-policy arms (every arm but the two
controls) and the seconds per step the seed's ``sft`` run's (the same plain-GT step; the sft run is added when
it is not asked for). Its run is configured for those steps, so its learning-rate schedule ends at its own
last step; the choice and its reason are stamped in its folder (``canonical_budget.json``) and in the summary
(``canonical_budget``). A control that still trained fewer seconds than the arm (its steps ran faster than the
sft run's) is sized again at its own pace and run again (``top_up``, at most twice), so it runs until it has
used the arm's seconds. ``--canonical-steps N`` fixes the length instead; with no on-policy arm it trains
``--steps``. Trained samples: a plain-GT or rollout-matching step trains ``per_device_train_batch_size x
gradient_accumulation_steps`` samples; a GRPO step trains ``prompts x num_generations`` completions, and the
arm uses ``(that batch) / GRPO_GENERATIONS`` prompts per step, so every arm trains the same number of samples
per step (``trained_samples`` in the summary counts the steps after the base). Training seconds: each
evaluation carries ``seconds``, the wall seconds the run spent in its steps after the base (evaluations
excluded; ``step_seconds``; the base's evaluation is at 0 s, so ``--base-steps`` is a multiple of
``--eval-every``), times the GPUs the run held on a GPU host (GPU-seconds: the learner's GPU and the rollout
server's when the harness started it, each GPU once: a server on the learner's GPU adds none; ``_ab.gpus``) —
``train_seconds`` and ``seconds_unit`` per run in the summary (``gpu``, or ``cpu`` wall seconds).

Writes ``runs/ab/<task>/ab.jsonl``: one line per evaluation, then a summary line per arm (the final F1 per
seed, mean, sd) with its pairing to each control of the same seed, ``paired_*`` to ``sft`` and
``canonical_paired_*`` to ``sft-canonical`` (``<P>`` below):

- by trained samples, where both runs end at the same step (one schedule length): ``<P>_diff`` (final F1
  minus the control's), ``<P>_mean``, ``_sd``, ``_min``, ``_max``, ``_ci95``; ``<P>_samples_unpaired``: the
  seeds whose control has another length (read mid-way through its schedule it would not be the control);
- at equal training seconds, on one seconds grid: each run's figures linearly interpolated between its
  evaluations' ``seconds`` (never past its last evaluation). ``<P>_at_seconds``: the arm's final seconds per
  seed, the headline grid point; ``<P>_at_seconds_seeds`` the seeds paired there and
  ``<P>_at_seconds_missing`` those whose control never reached the arm's seconds (a missing pair, never
  read at an earlier evaluation); ``<P>_at_seconds_<figure>`` for ``f1``, ``precision``, ``recall``,
  ``duplicates`` and ``pred_gt_ratio``: ``diff`` (arm minus control per paired seed), ``mean``, ``sd``,
  ``min``, ``max``, ``ci95`` (Student's t 95 % interval of the mean, two seeds or more), ``arm`` and
  ``control`` (the values); ``<P>_at_fractions_f1``: the same F1 pairing at 0.25, 0.5, 0.75 and 1 of the
  arm's final seconds (keys ``"0.25"`` … ``"1"``); ``<P>_seconds_ratio``: the arm's final seconds ÷ the
  control's; ``canonical_paired_stretched``: the seeds whose control was sized to a slower arm (more than
  10 % more seconds), left out of the pairing at seconds (run such an arm with a control of its own:
  ``bench/equal_seconds_ab_gpu.sh`` gives every arm its own folder).

The ``sft-canonical`` line also holds the base order measured per seed (``base_order``), how its steps were
chosen (``canonical_budget``: ``steps``, ``reason``, ``arm``, ``arm_seconds``, ``sft_step_seconds``,
``unit``) and, where it still trained fewer seconds than the slowest on-policy arm (its first step's warm-up
made the estimate low), ``canonical_seconds_short`` (seed, arm, both seconds; that arm's headline pair is
then missing). Also ``ab.png`` (F1, precision, recall, F1 at maskIoU 0.5, duplicates and predicted ÷ GT by
step, mean line and min-max band per arm, the controls dashed; and F1 by training seconds with every arm on
one seconds axis: each run interpolated on a common grid, the mean and min-max band over seeds drawn where
every seed reached those seconds, the evaluations as dots; each arm's paired means against both controls in
the legend, ``@s`` at equal seconds) and, with a GRPO
arm, ``grpo.png`` (reward, KL, completion length per step). One rollout server (the task config's
``server:`` section) serves every run unless ``--server-url`` names one or ``--colocate`` rolls out
in-process; a run's first rollout step syncs its weights, so runs can share a server. Finished runs are reused
(delete the run directory to redo one).

Runs side by side on one GPU (one process per seed, e.g. with ``--vllm-gpu-memory 0.06 --vllm-sleep-level
0``: vLLM's start fails when another process frees GPU memory meanwhile, as a sleeping engine does) slow
each other unevenly; ``--price-seed S`` prices every run's seconds at what its arm's step cost on seed
``S``'s runs, run alone first (`_ab.step_prices`): run ``--seeds S`` alone, then the other seeds side by
side with ``--price-seed S``, then ``--summarize-only --seeds S,... --price-seed S`` (or ``--from-runs
--price-seed S`` on the folders copied back).

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
from _ab.tables import ARMS, CANONICAL, CONTROLS, GRPO_ARMS, REPO, TASKS, resumes_base  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command line (checked further by :func:`main`)."""
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
        help=f"{CANONICAL}: a fixed step count (default: sized per seed to the on-policy arms' seconds)",
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
    parser.add_argument(
        "--grpo-colocate-backend",
        choices=["hf", "vllm"],
        default="hf",
        help="the GRPO arms' colocated engine (vllm: as the supervised arms', with --vllm-gpu-memory and"
        " --vllm-sleep-level)",
    )
    parser.add_argument(
        "--vllm-gpu-memory",
        type=float,
        default=None,
        help="colocated vLLM's gpu_memory_utilization (default 0.35; lower it for runs side by side)",
    )
    parser.add_argument(
        "--vllm-sleep-level",
        type=int,
        choices=[0, 1, 2],
        default=None,
        help="colocated vLLM's sleep_level (default 1); 0 for runs side by side (no memory freed mid-run)",
    )
    parser.add_argument(
        "--price-seed",
        type=int,
        default=None,
        help="price every run's seconds at this seed's runs' seconds per step (those ran alone)",
    )
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.at_step is not None and not args.from_runs:
        parser.error("--at-step goes with --from-runs")
    if args.from_runs:
        out = (args.out or REPO / "runs" / "ab" / args.task).resolve()
        arms = args.arms.split(",") if args.arms else None
        return summarize_copied_runs(
            args.task, out, args.steps, args.at_step, arms, args.canonical_steps, args.price_seed
        )
    if args.smoke:
        args.seeds, args.base_steps, args.steps = "0", 2, 2
        args.eval_every, args.eval_samples = 2, 8
        args.arms = args.arms or "sft,rm-reorder"
    args.arms = args.arms or "sft,rm-keep,rm-drop"
    unknown = sorted(set(args.arms.split(",")) - set(ARMS) - set(GRPO_ARMS) - {CANONICAL})
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; known: {sorted([*ARMS, *GRPO_ARMS, CANONICAL])}")
    if args.base_steps % args.eval_every or args.steps % args.eval_every:
        parser.error(
            f"--base-steps {args.base_steps} and --steps {args.steps} must be multiples of --eval-every"
            f" {args.eval_every} (the shared base is every run's evaluation at 0 s; the arms end on one)"
        )
    if args.vllm_gpu_memory is not None and not 0 < args.vllm_gpu_memory < 1:
        parser.error(
            f"--vllm-gpu-memory {args.vllm_gpu_memory} must be in (0, 1): a share of the GPU's memory"
        )
    if args.canonical_steps is not None and args.canonical_steps < 1:
        parser.error(f"--canonical-steps {args.canonical_steps} must be >= 1")
    if args.order_samples < 1:
        parser.error(f"--order-samples {args.order_samples} must be >= 1")
    arms = args.arms.split(",")
    grpo_arms = [a for a in arms if a in GRPO_ARMS]
    if grpo_arms and not args.colocate:
        parser.error(
            f"{grpo_arms} run with --colocate only (GRPO rolls out with its own HF engine in-process)"
        )
    from_base = [a for a in arms if resumes_base(a)]  # start from the seed's base checkpoint
    on_policy = [a for a in arms if a not in CONTROLS]
    # sized by seconds, the control needs the sft run's seconds per step and the on-policy arms' seconds
    sized = CANONICAL in arms and args.canonical_steps is None and bool(on_policy)
    if (from_base and args.base_steps > 0) or sized:  # the sft run is their base checkpoint: it runs first
        arms = ["sft", *[a for a in arms if a != "sft"]]
    if CANONICAL in arms:  # last: after the arms whose seconds it is given
        arms = [*[a for a in arms if a != CANONICAL], CANONICAL]
    return run_ab(args, arms)


if __name__ == "__main__":
    sys.exit(main())

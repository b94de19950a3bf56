"""Stage-1 SFT of the image demo model: plain teacher-forced training on the synthetic image set.

Rollout-matching SFT starts from a stage-1 checkpoint: for the image demo, ``tiny-qwen3-vl-demo`` after this
script trained it on ``learner/demo_data/images.py``'s ``train`` split and stopped EARLY (held-out F1 well
below 0.5, room for rollout-matching to show learning). Shipped as ``assets/tiny-qwen3-vl-demo-stage1/``;
``scripts/build_tiny_vlm.py`` re-runs this script only without it (minutes on a GPU, far longer on 2 CPUs).

A thin command over the learner: the flags become a learner run config (:func:`run_config`), and every row,
batch, loss and score is the learner's own:

- rows: ``learner.trainers.build.load_samples``, then ``learner.stage2.pipeline.stage1_segment``: the rollout
  prompt (``PromptEncoder``), the GT answer in the learner's plain-GT token path (``answer_ids``: ``{`` alone,
  not the merged ``{"`` of the whole text, which collapsed the crowded A/B: bench/RESULTS.md "Crowded
  scenes") and ``<|im_end|>``, every answer token and ``<|im_end|>`` labelled for CE;
- batches: ``learner.batching.packed_batch.pad_segments``; loss: ``learner.stage2.step.micro_step_loss``,
  which on these rows is the mean token cross-entropy over the answer tokens and ``<|im_end|>``;
- held-out F1 (``--eval-at``): ``learner.evaluate.runner.evaluate_samples``, the training loop's evaluation
  (greedy decoding by the colocated HF backend, parse, match with the default ``stage2.matching``).

The prompts default to the image demo's (``DEMO_SYSTEM_PROMPT`` / ``DEMO_USER_PROMPT`` = ``prompts:`` of
configs/demo_vlm_cpu.yaml): the learner must roll out with the prompts the checkpoint was trained on. The
learning rate is constant after a linear warm-up, so the snapshot at step k of a longer run is the model that
``--steps k`` trains.

The shipped asset (F1 curve: ``assets/tiny-qwen3-vl-demo-stage1/pretrain_info.json``) was trained by this
script as of commit d138f36 on one H100 (torch 2.11, transformers 5.17; deterministic on one device kind)::

    python scripts/build_vlm_demo_data.py --out .cache/data/demo_vlm
    python scripts/build_tiny_vlm.py --preset tiny-qwen3-vl-demo --out .cache/models
    python scripts/vlm_pretrain.py --model-dir .cache/models/tiny-qwen3-vl-demo-init \\
        --data .cache/data/demo_vlm --out assets/tiny-qwen3-vl-demo-stage1 --device cuda

That commit had its own collate, loss and ``generate`` decoding. The learner's functions give the same rows,
the same loss to float rounding (tests/unit/test_vlm_pretrain.py; 6 CPU steps: losses equal to 1e-6) and the
same greedy tokens (tests/integration/test_colocate_hf_image.py), through other kernels (logits only where the
loss reads, mask-free causal attention, M-RoPE positions passed in): the same recipe, not the same bits.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHIM_DIR = REPO / "shared_schemas" / "vlm_shim"
for _p in (REPO, SHIM_DIR):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import tinyvlm_compat  # noqa: E402

tinyvlm_compat.install()  # a no-op where torchvision imports

import torch  # noqa: E402

from learner.batching.packed_batch import pad_segments  # noqa: E402
from learner.config import RunConfig  # noqa: E402
from learner.data.prompt_encoding import PromptEncoder  # noqa: E402
from learner.demo_data.images import DEMO_SYSTEM_PROMPT, DEMO_USER_PROMPT  # noqa: E402
from learner.evaluate.runner import evaluate_samples  # noqa: E402
from learner.stage2.pipeline import SampleContext, stage1_segment  # noqa: E402
from learner.stage2.step import micro_step_loss  # noqa: E402
from learner.stage2.targets.segment import Segment  # noqa: E402
from learner.trainers.build import build_rollout_source, load_samples, sample_context  # noqa: E402

logger = logging.getLogger(__name__)

CURVE_METRICS = ("f1", "precision", "recall", "sample_valid_pred_rate", "matched_maskiou_mean")
"""The ``eval_rollout_*`` metrics of a point of the F1-vs-steps curve (``pretrain_info.json``)."""


@dataclass(frozen=True)
class PretrainConfig:
    """Recipe of the shipped asset.

    Attributes:
        steps: optimizer steps.
        batch: rows per step.
        lr: AdamW learning rate after warm-up (constant).
        warmup: linear warm-up steps.
        weight_decay: AdamW weight decay.
        clip: gradient-norm clip.
        seed: torch seed and data-order seed.
        max_new_tokens: greedy decoding budget of the held-out evaluation.
        system_prompt: the rollout prompt's system text (``prompts.system`` of the learner starting from it).
        user_prompt: the user text after the image (``prompts.user``).
    """

    steps: int = 250
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    max_new_tokens: int = 200
    system_prompt: str = DEMO_SYSTEM_PROMPT
    user_prompt: str = DEMO_USER_PROMPT


def run_config(cfg: PretrainConfig, model_dir: Path, data: Path, object_ordering: str) -> RunConfig:
    """The learner run config whose rows and evaluation this stage-1 uses: ``cfg``'s prompts and seed,
    ``data``'s splits in ``object_ordering`` (random: seeded by the seed, as the learner orders them),
    greedy decoding of ``cfg.max_new_tokens`` tokens by the training model itself, and a malformed GT
    object an error (a stage-1 answer never leaves one out)."""
    splits = {split: [str((data / f"{split}.jsonl").resolve())] for split in ("train", "eval")}
    # greedy, 64 held-out rows per decode call
    decoding = {"temperature": 0.0, "max_new_tokens": cfg.max_new_tokens, "rollout_generate_batch_size": 64}
    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir.resolve())},
            "data": {**splits, "object_ordering": object_ordering},
            "prompts": {"system": cfg.system_prompt, "user": cfg.user_prompt},
            "rollout": {"mode": "colocate", "backend": "hf", "decoding": decoding},
            "stage2": {"gt": {"malformed_policy": "raise"}},
            "training": {"seed": cfg.seed},
        }
    )


def pretrain(
    model: Any,
    rows: Sequence[Segment],
    cfg: PretrainConfig,
    ctx: SampleContext,
    device: str,
    on_step: Callable[[int, float], bool | None] | None = None,
) -> int:
    """Train ``model`` in place for ``cfg.steps`` steps on stage-1 ``rows`` (``stage1_segment``);
    ``on_step(step, loss)`` runs after every step and stops training early when it returns True. Returns the
    number of steps taken.

    Rows are drawn as seeded per-epoch permutations (``random.Random(cfg.seed)``); a step's loss is
    ``micro_step_loss`` of its padded rows (bf16 autocast on CUDA).
    """
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    coord_ids = torch.tensor(ctx.coord_vocab.ids, dtype=torch.long)
    order: list[int] = []
    model.train()
    for step in range(1, cfg.steps + 1):
        while len(order) < cfg.batch:
            perm = list(range(len(rows)))
            rng.shuffle(perm)
            order += perm
        picked, order = order[: cfg.batch], order[cfg.batch :]
        batch = pad_segments([rows[r] for r in picked], ctx.tokenizer.pad_token_id).to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            # rows without coord slots: the step's loss is its CE sum over its CE count (stage2.loss defaults)
            loss = micro_step_loss(model, batch, coord_ids=coord_ids, eos_id=ctx.eot_id).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        sched.step()
        if on_step is not None and on_step(step, loss.item()):
            return step
    return cfg.steps


def save_weights(model: Any, out_dir: Path) -> None:
    """Write the model's config and its weights in bf16 (``model.safetensors``) into ``out_dir``."""
    state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)


def save_model(model: Any, processor: Any, out_dir: Path, info: dict[str, Any]) -> None:
    """Write ``out_dir`` atomically: bf16 safetensors, processor files and ``pretrain_info.json``."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_weights(model, tmp)
    processor.save_pretrained(tmp)
    (tmp / "pretrain_info.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def save_snapshot(model: Any, path: Path) -> None:
    """Only the bf16 ``model.safetensors`` of :func:`save_model`, as ``path`` (a snapshot to pick from)."""
    tmp = path.with_name(path.name + ".dir")
    shutil.rmtree(tmp, ignore_errors=True)
    save_weights(model, tmp)
    (tmp / "model.safetensors").replace(path)
    shutil.rmtree(tmp)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command's flags (``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model-dir", type=Path, required=True, help="random-init tiny-qwen3-vl-demo")
    add("--data", type=Path, required=True, help="folder with train.jsonl and eval.jsonl")
    add("--out", type=Path, required=True, help="the stage-1 model folder to write")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--steps", type=int, default=PretrainConfig.steps, help="0: only score --model-dir")
    add("--batch", type=int, default=PretrainConfig.batch)
    add("--lr", type=float, default=PretrainConfig.lr)
    add("--seed", type=int, default=PretrainConfig.seed)
    add("--system-prompt", default=PretrainConfig.system_prompt, help="prompts.system")
    add("--user-prompt", default=PretrainConfig.user_prompt, help="prompts.user")
    add("--n-eval", type=int, default=64, help="held-out rows scored")
    add("--object-ordering", choices=("sorted", "random"), default="sorted", help="data.object_ordering")
    add("--max-new-tokens", type=int, default=PretrainConfig.max_new_tokens, help="held-out decoding budget")
    add(
        "--fast", action="store_true", help="CUDA: TF32, non-deterministic kernels (not bitwise reproducible)"
    )
    add("--max-seconds", type=float, help="stop after this many training seconds (then score and save)")
    add("--stop-at-f1", type=float, help="stop at the first --eval-at whose held-out F1 reaches this; save")
    add("--eval-at", default="", help="comma-separated steps at which to log held-out F1")
    add("--snapshot-at", default="", help="comma-separated steps at which to save OUT.step_K.safetensors")
    add("--snapshot-dir", type=Path, default=None, help="folder of the snapshots (default: OUT's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = args.fast
        torch.use_deterministic_algorithms(not args.fast, warn_only=True)
    cfg = PretrainConfig(**{f.name: getattr(args, f.name) for f in fields(PretrainConfig) if f.name in args})
    run = run_config(cfg, args.model_dir, args.data, args.object_ordering)
    processor = AutoProcessor.from_pretrained(args.model_dir)
    tokenizer = processor.tokenizer
    torch.manual_seed(cfg.seed)
    model = AutoModelForImageTextToText.from_pretrained(args.model_dir, dtype=torch.float32).to(args.device)
    encoder = PromptEncoder.for_model(model, tokenizer, processor)
    ctx = sample_context(run, tokenizer, encoder)
    source = build_rollout_source(run, model, tokenizer, encoder)
    t0 = time.perf_counter()
    rows = [stage1_segment(s, ctx) for s in load_samples(run.data.train, run)] if cfg.steps else []
    held_out = load_samples(run.data.eval, run)[: args.n_eval]
    logger.info("encoded %d train rows in %.1f s", len(rows), time.perf_counter() - t0)

    def held_out_metrics() -> dict[str, float]:
        return evaluate_samples(run, source, ctx, held_out, batch_size=len(held_out))[0]

    if cfg.steps == 0:  # score the loaded model only
        print(json.dumps(held_out_metrics()))
        return 0
    eval_at = {int(s) for s in args.eval_at.split(",") if s} | {cfg.steps}
    snapshot_at = {int(s) for s in args.snapshot_at.split(",") if s}
    curve: list[dict[str, float]] = []
    losses: list[float] = []
    start = time.perf_counter()

    def on_step(step: int, loss: float) -> bool:
        losses.append(loss)
        recent = sum(losses[-50:]) / len(losses[-50:])
        stop = args.max_seconds is not None and time.perf_counter() - start > args.max_seconds
        if stop and step < cfg.steps:
            logger.info("--max-seconds %.0f reached at step %d", args.max_seconds, step)
            eval_at.add(step)
        if step % 50 == 0:
            logger.info("step %d loss %.4f (%.1f s)", step, recent, time.perf_counter() - start)
        if step in eval_at:
            m = held_out_metrics()
            row = {"step": step, "loss": round(recent, 4)}
            row |= {k: round(m[f"eval_rollout_{k}"], 4) for k in CURVE_METRICS}
            curve.append(row)
            logger.info("eval %s", json.dumps(row))
            if args.stop_at_f1 is not None and row["f1"] >= args.stop_at_f1 and step < cfg.steps:
                logger.info(
                    "--stop-at-f1 %.3f reached at step %d (F1 %.4f)", args.stop_at_f1, step, row["f1"]
                )
                stop = True
        if step in snapshot_at:
            folder = args.snapshot_dir or args.out.parent
            save_snapshot(model, folder / f"{args.out.name}.step_{step}.safetensors")
        return stop

    steps = pretrain(model, rows, cfg, ctx, args.device, on_step)
    info = {
        "config": asdict(cfg),
        "object_ordering": args.object_ordering,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "steps": steps,
        "fast": args.fast,
        "train_seconds": round(time.perf_counter() - start, 1),
        "curve": curve,
    }
    save_model(model, processor, args.out, info)
    print(json.dumps(curve))
    return 0 if math.isfinite(losses[-1]) else 1


if __name__ == "__main__":
    sys.exit(main())

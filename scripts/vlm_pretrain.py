"""Stage-1 SFT of the image demo model: plain teacher-forced training on the synthetic image set.

Rollout-matching SFT starts from a stage-1 SFT checkpoint. For the image demo that checkpoint is
``tiny-qwen3-vl-demo`` (``scripts/build_tiny_vlm.py``, preset ``tiny-qwen3-vl-demo``) after this script has
trained it on the ``train`` split of ``learner/demo_data/images.py`` — and stopped EARLY, while its held-out
detection F1 is still well below 0.5, so that rollout-matching SFT has room to show learning. The result is
shipped as ``assets/tiny-qwen3-vl-demo-stage1/`` because training it takes minutes on a GPU and far longer on
2 CPU cores; ``build_tiny_vlm.py`` copies the asset and re-runs this script only when the asset is missing.

One training row is exactly what the learner teacher-forces for an empty rollout: the rollout prompt
(``learner.data.messages.rollout_messages`` of ``build_sample(record, include_assistant=True)``: the system
prompt, then the user turn with the image part first and the user prompt, then ``<|im_start|>assistant\\n``),
the GT answer (``serialize_objects``, §4) and ``<|im_end|>``. The prompts default to the image demo's short
ones (``learner.demo_data.images.DEMO_SYSTEM_PROMPT`` / ``DEMO_USER_PROMPT``, also ``prompts:`` of
configs/demo_vlm_cpu.yaml; ``--system-prompt`` / ``--user-prompt`` change them): the learner must roll out
with the prompts the checkpoint was trained on. The loss is the mean token cross-entropy over the answer
tokens and ``<|im_end|>`` only. The learning rate is constant after a linear warm-up, so the snapshot at step
k of a longer run is the model that ``--steps k`` trains.

Held-out detection F1 (``--eval-at``) is measured as the learner's evaluation does: greedy decoding (HF
``generate``), then ``learner.stage2.pipeline.score_rollout`` (parse, match with the default
``stage2.matching``, maskIoU gate 0.3) and ``eval_metrics``.

Shipped asset (measured F1 and the F1-vs-steps curve:
``assets/tiny-qwen3-vl-demo-stage1/pretrain_info.json``)::

    python scripts/build_vlm_demo_data.py --out .cache/data/demo_vlm
    python scripts/build_tiny_vlm.py --preset tiny-qwen3-vl-demo --out .cache/models
    python scripts/vlm_pretrain.py --model-dir .cache/models/tiny-qwen3-vl-demo-init \\
        --data .cache/data/demo_vlm --out assets/tiny-qwen3-vl-demo-stage1 --device cuda

on one NVIDIA H100 (torch 2.11, transformers 5.17); seeded and deterministic on one device kind.
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
from dataclasses import asdict, dataclass
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
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402

from learner.data.messages import rollout_messages  # noqa: E402
from learner.data.records import build_sample, load_records  # noqa: E402
from learner.demo_data.images import DEMO_SYSTEM_PROMPT, DEMO_USER_PROMPT  # noqa: E402
from learner.stage2.coords import CoordVocab  # noqa: E402
from learner.stage2.gt import extract_gt  # noqa: E402
from learner.stage2.matching.match import MatchingConfig  # noqa: E402
from learner.stage2.pipeline import eval_metrics, score_rollout  # noqa: E402
from learner.stage2.targets.y_train import answer_ids  # noqa: E402
from shared_schemas.infer import Choice, InferResult  # noqa: E402

logger = logging.getLogger(__name__)

IGNORE = -100


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


@dataclass
class EncodedSet:
    """Teacher-forcing rows of one split: a shared prompt, per-row answer ids and image tensors.

    Attributes:
        prompt_ids: the rollout prompt (image tokens expanded); identical for every row because every image
            has the same size.
        answers: per row, answer ids followed by ``<|im_end|>`` (the supervised tokens).
        pixel_values: per row, the image processor's patches ``[patches, channels * 2 * 16 * 16]``.
        grid_thw: per row, ``[1, grid_h, grid_w]``.
        samples: the §1.5 sample dicts (for scoring).
        prompt_mm_types: the processor's ``mm_token_type_ids`` of the prompt (1 at image tokens), when it
            returns them (transformers >= 5.19 needs them for M-RoPE); answer tokens are type 0.
    """

    prompt_ids: list[int]
    answers: list[list[int]]
    pixel_values: list[torch.Tensor]
    grid_thw: list[torch.Tensor]
    samples: list[dict[str, Any]]
    prompt_mm_types: list[int] | None = None


def answer_token_ids(sample: dict[str, Any], tokenizer: Any, coord_vocab: CoordVocab) -> list[int]:
    """The supervised ids of one row: the GT answer in the learner's plain-GT token path
    (``learner.stage2.targets.y_train.answer_ids``: ``{`` alone, then the entries and the close as one
    fragment), then ``<|im_end|>``.

    Not ``tokenizer.encode(answer)``: that merges the opening ``{"`` into one token, a path the learner's
    plain-GT and ``reorder`` targets never train. A stage-1 trained on it (the crowded model of 2026-11-27,
    F1 0.78) lost every answer within 8 learner steps at lr 3e-4 while moving to the learner's path: it
    began answers with ``object_1"`` and parsed to nothing (bench/RESULTS.md "Crowded scenes"); the text
    demo collapsed the same way the other way round (issue 23).
    """
    objects = extract_gt(sample["gt_objects"], sample["sample_id"], policy="raise").objects
    return answer_ids(objects, tokenizer, coord_vocab) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def load_split(
    processor: Any,
    jsonl: Path,
    limit: int | None = None,
    *,
    system_prompt: str = DEMO_SYSTEM_PROMPT,
    user_prompt: str = DEMO_USER_PROMPT,
    ordering: str = "sorted",
    seed: int = 0,
) -> EncodedSet:
    """Encode one JSONL split with the processor (the learner's prompt layout, §3, with these prompts).

    Raises:
        ValueError: the images of the split do not all give the same prompt (different sizes).
    """
    tok = processor.tokenizer
    coord_vocab = CoordVocab.from_tokenizer(tok)
    records = load_records(jsonl)[:limit]
    prompt_ids: list[int] | None = None
    out = EncodedSet([], [], [], [], [])
    for i, record in enumerate(records):
        sample = build_sample(
            record,
            base_idx=i,
            dataset=jsonl.stem,
            dataset_namespace=0,
            system_prompt=system_prompt,
            user_prompt=user_prompt,
            ordering=ordering,  # type: ignore[arg-type]
            seed=seed,
            include_assistant=True,
        )
        image = Image.open(sample["images"][0]).convert("RGB")
        text = processor.apply_chat_template(
            rollout_messages(sample["messages"], system_prompt),
            tokenize=False,
            add_generation_prompt=True,
        )
        enc = processor(text=[text], images=[image], return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        if prompt_ids is None:
            prompt_ids = ids
            if "mm_token_type_ids" in enc:
                out.prompt_mm_types = enc["mm_token_type_ids"][0].tolist()
        elif ids != prompt_ids:
            raise ValueError(f"{jsonl}: record {i} gives another prompt (image size differs from record 0)")
        ids = answer_token_ids(sample, tok, coord_vocab)
        if tok.decode(ids[:-1]) != sample["messages"][-1]["content"]:
            raise ValueError(f"{jsonl}: record {i}: the answer's token path does not decode to its text")
        out.answers.append(ids)
        out.pixel_values.append(enc["pixel_values"])
        out.grid_thw.append(enc["image_grid_thw"])
        out.samples.append(sample)
    out.prompt_ids = prompt_ids or []
    return out


def collate(data: EncodedSet, rows: Sequence[int], pad_id: int, device: str) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids``, ``attention_mask``, ``labels`` (answer tokens only),
    image tensors."""
    seqs = [data.prompt_ids + data.answers[r] for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    n_prompt = len(data.prompt_ids)
    for b, (r, s) in enumerate(zip(rows, seqs, strict=True)):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
        labels[b, n_prompt : len(s)] = torch.tensor(data.answers[r])
    batch = {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "labels": labels.to(device),
        **image_inputs(data, rows, width, device),
    }
    return batch


def image_inputs(data: EncodedSet, rows: Sequence[int], width: int, device: str) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of ``rows``, plus ``mm_token_type_ids`` (``width`` columns)
    when the processor gives them."""
    out = {
        "pixel_values": torch.cat([data.pixel_values[r] for r in rows]).to(device),
        "image_grid_thw": torch.cat([data.grid_thw[r] for r in rows]).to(device),
    }
    if data.prompt_mm_types is not None:
        types = torch.zeros((len(rows), width), dtype=torch.long)
        types[:, : len(data.prompt_mm_types)] = torch.tensor(data.prompt_mm_types)
        out["mm_token_type_ids"] = types.to(device)
    return out


def answer_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (answer + ``<|im_end|>``) positions."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


@torch.no_grad()
def greedy_answers(
    model: Any, data: EncodedSet, eos_ids: Sequence[int], max_new_tokens: int, device: str, batch: int = 64
) -> list[tuple[list[int], str]]:
    """Greedy completions ``(token_ids up to and including the first stop id, finish_reason)`` per row."""
    model.eval()
    out: list[tuple[list[int], str]] = []
    n_prompt = len(data.prompt_ids)
    for start in range(0, len(data.samples), batch):
        rows = list(range(start, min(start + batch, len(data.samples))))
        ids = torch.tensor([data.prompt_ids] * len(rows), device=device)
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **image_inputs(data, rows, n_prompt, device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
        for row in gen[:, n_prompt:].tolist():
            stop = next((j for j, t in enumerate(row) if t in eos_ids), None)
            out.append((row[: stop + 1], "stop") if stop is not None else (row, "length"))
    model.train()
    return out


@dataclass(frozen=True)
class ScoreContext:
    """The parts of ``learner.stage2.pipeline.SampleContext`` that ``score_rollout`` reads (parse + match),
    with the learner's default ``stage2`` knobs; evaluation needs no prompt encoder, targets or packing."""

    tokenizer: Any
    coord_vocab: CoordVocab
    stop_markers: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
    matching: MatchingConfig = MatchingConfig()
    malformed_policy: str = "skip"


def detection_metrics(
    model: Any, processor: Any, data: EncodedSet, max_new_tokens: int, device: str
) -> dict[str, float]:
    """``eval_rollout_*`` metrics (§18) of greedy decoding on ``data``."""
    tok = processor.tokenizer
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    ctx = ScoreContext(tok, CoordVocab.from_tokenizer(tok))
    start = time.perf_counter()
    sums: dict[str, float] = {}
    for i, (ids, finish) in enumerate(greedy_answers(model, data, eos, max_new_tokens, device)):
        result = InferResult(
            index=i,
            prompt_token_ids=data.prompt_ids,
            choices=[Choice(token_ids=ids, text="", finish_reason=finish)],  # type: ignore[arg-type]
            weight_version=0,
        )
        for key, value in score_rollout(data.samples[i], result, ctx).items():  # type: ignore[arg-type]
            sums[key] = sums.get(key, 0.0) + value
    return eval_metrics(sums, n_samples=len(data.samples), runtime_s=time.perf_counter() - start)


def pretrain(
    model: Any,
    train: EncodedSet,
    cfg: PretrainConfig,
    device: str,
    pad_id: int,
    on_step: Callable[[int, float], bool | None] | None = None,
) -> int:
    """Train ``model`` in place for ``cfg.steps`` steps; ``on_step(step, loss)`` runs after every step and
    stops training early when it returns True. Returns the number of steps taken.

    Rows are drawn as seeded per-epoch permutations of the split (``random.Random(cfg.seed)``).
    """
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    order: list[int] = []
    model.train()
    for step in range(1, cfg.steps + 1):
        while len(order) < cfg.batch:
            perm = list(range(len(train.samples)))
            rng.shuffle(perm)
            order += perm
        rows, order = order[: cfg.batch], order[cfg.batch :]
        batch = collate(train, rows, pad_id, device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            loss = answer_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        sched.step()
        if on_step is not None and on_step(step, loss.item()):
            return step
    return cfg.steps


def save_model(model: Any, processor: Any, out_dir: Path, info: dict[str, Any]) -> None:
    """Write ``out_dir`` atomically: bf16 safetensors, processor files and ``pretrain_info.json``."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    processor.save_pretrained(tmp)
    (tmp / "pretrain_info.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def save_weights(model: Any, path: Path) -> None:
    """Only the bf16 ``model.safetensors`` of :func:`save_model`, as ``path`` (a snapshot to pick from)."""
    tmp = path.with_name(path.name + ".dir")
    shutil.rmtree(tmp, ignore_errors=True)
    state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    (tmp / "model.safetensors").replace(path)
    shutil.rmtree(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="random-init tiny-qwen3-vl-demo")
    parser.add_argument("--data", type=Path, required=True, help="folder with train.jsonl and eval.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="the stage-1 model folder to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=PretrainConfig.steps, help="0: only score --model-dir")
    parser.add_argument("--batch", type=int, default=PretrainConfig.batch)
    parser.add_argument("--lr", type=float, default=PretrainConfig.lr)
    parser.add_argument("--seed", type=int, default=PretrainConfig.seed)
    parser.add_argument("--system-prompt", default=PretrainConfig.system_prompt, help="prompts.system")
    parser.add_argument("--user-prompt", default=PretrainConfig.user_prompt, help="prompts.user")
    parser.add_argument("--n-eval", type=int, default=64, help="held-out rows scored")
    parser.add_argument(
        "--object-ordering",
        choices=("sorted", "random"),
        default="sorted",
        help="data.object_ordering of the answers trained on (random: seeded by --seed, as the learner does)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=PretrainConfig.max_new_tokens, help="held-out decoding budget"
    )
    parser.add_argument(
        "--fast",
        action="store_true",
        help="CUDA: TF32 matmuls and non-deterministic kernels (faster; not bitwise reproducible)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop after this many training seconds (then score and save as at the last step)",
    )
    parser.add_argument(
        "--stop-at-f1",
        type=float,
        default=None,
        help="stop at the first --eval-at evaluation whose held-out F1 reaches this, then save",
    )
    parser.add_argument("--eval-at", default="", help="comma-separated steps at which to log held-out F1")
    parser.add_argument(
        "--snapshot-at", default="", help="comma-separated steps at which to save OUT.step_K.safetensors"
    )
    parser.add_argument(
        "--snapshot-dir", type=Path, default=None, help="folder of the snapshots (default: OUT's)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = args.fast
        torch.use_deterministic_algorithms(not args.fast, warn_only=True)
    cfg = PretrainConfig(
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        system_prompt=args.system_prompt,
        user_prompt=args.user_prompt,
    )
    processor = AutoProcessor.from_pretrained(args.model_dir)
    torch.manual_seed(cfg.seed)
    model = AutoModelForImageTextToText.from_pretrained(args.model_dir, dtype=torch.float32).to(args.device)
    t0 = time.perf_counter()
    prompts = {
        "system_prompt": cfg.system_prompt,
        "user_prompt": cfg.user_prompt,
        "ordering": args.object_ordering,
        "seed": cfg.seed,
    }
    train = load_split(processor, args.data / "train.jsonl", limit=None if args.steps else 0, **prompts)
    held_out = load_split(processor, args.data / "eval.jsonl", limit=args.n_eval, **prompts)
    logger.info(
        "encoded %d train / %d eval rows (%d prompt tokens) in %.1f s",
        len(train.samples),
        len(held_out.samples),
        len(held_out.prompt_ids),
        time.perf_counter() - t0,
    )
    eval_at = {int(s) for s in args.eval_at.split(",") if s} | {cfg.steps}
    snapshot_at = {int(s) for s in args.snapshot_at.split(",") if s}
    curve: list[dict[str, float]] = []
    losses: list[float] = []
    info: dict[str, Any] = {
        "config": asdict(cfg),
        "object_ordering": args.object_ordering,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
    }
    start = time.perf_counter()

    def on_step(step: int, loss: float) -> bool:
        losses.append(loss)
        stop = args.max_seconds is not None and time.perf_counter() - start > args.max_seconds
        if stop and step < cfg.steps:
            logger.info("--max-seconds %.0f reached at step %d", args.max_seconds, step)
            eval_at.add(step)
        if step % 50 == 0:
            logger.info(
                "step %d loss %.4f (%.1f s)",
                step,
                sum(losses[-50:]) / len(losses[-50:]),
                time.perf_counter() - start,
            )
        if step in eval_at:
            m = detection_metrics(model, processor, held_out, cfg.max_new_tokens, args.device)
            row = {"step": step, "loss": round(sum(losses[-50:]) / len(losses[-50:]), 4)}
            row |= {
                k.removeprefix("eval_rollout_"): round(m[k], 4)
                for k in (
                    "eval_rollout_f1",
                    "eval_rollout_precision",
                    "eval_rollout_recall",
                    "eval_rollout_sample_valid_pred_rate",
                    "eval_rollout_matched_maskiou_mean",
                )
            }
            curve.append(row)
            logger.info("eval %s", json.dumps(row))
            if args.stop_at_f1 is not None and row["f1"] >= args.stop_at_f1 and step < cfg.steps:
                logger.info(
                    "--stop-at-f1 %.3f reached at step %d (F1 %.4f)", args.stop_at_f1, step, row["f1"]
                )
                stop = True
        if step in snapshot_at:
            save_weights(
                model, (args.snapshot_dir or args.out.parent) / f"{args.out.name}.step_{step}.safetensors"
            )
        return stop

    if cfg.steps == 0:  # score the loaded model only
        print(json.dumps(detection_metrics(model, processor, held_out, cfg.max_new_tokens, args.device)))
        return 0
    steps = pretrain(model, train, cfg, args.device, processor.tokenizer.pad_token_id, on_step)
    info |= {
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

"""A short SFT warm start of the tiny demo LM on the synthetic summary answers (CPU demo only).

A randomly initialised tiny LM never emits anything the summary rewards can tell apart (every completion
scores the same, so every GRPO group has zero variance and there is no signal). The usual recipe applies:
GRPO starts from an SFT checkpoint. This module trains a deliberately *short* teacher-forced SFT (a few
dozen steps) so the model knows the answer skeleton only partly; GRPO then has rewards to raise.

A Qwen-VL checkpoint (rows with ``images``) is warm-started through the GRPO learner's own path: the policy
loader, the run's prompt encoder (processor expansion, vision tensors, M-RoPE positions) and the GRPO
micro-batch forward (:func:`learner.grpo.batch.collate_rows`, :func:`~learner.grpo.batch.completion_logps`),
so the SFT sees exactly the inputs GRPO later trains on; the loss is the mean answer-token NLL.

Deterministic for a given ``(model, rows, steps, lr, seed)`` on one machine (single-threaded CPU kernels
are not guaranteed bit-identical across machines; the demo does not need that).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["WARM_START_RECIPE", "sft_examples", "warm_start"]

logger = logging.getLogger(__name__)

WARM_START_RECIPE = 1
"""Bump when the procedure changes, so cached checkpoints are rebuilt."""


def sft_examples(
    tokenizer: Any, rows: Sequence[dict[str, Any]], eot: str = "<|im_end|>"
) -> list[tuple[list[int], int]]:
    """``(ids, prompt_len)`` per row: templated prompt + ``answer`` + end-of-turn token.

    Only the ``ids[prompt_len:]`` part is supervised.
    """
    out = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(row["answer"] + eot, add_special_tokens=False)
        out.append((prompt_ids + answer_ids, len(prompt_ids)))
    return out


def _batch(examples: Sequence[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, prompt_len) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def warm_start(
    model_dir: Path,
    out_dir: Path,
    rows: Sequence[dict[str, Any]],
    *,
    steps: int = 40,
    batch_size: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
    image_root: Path | None = None,
) -> Path:
    """Trains ``steps`` SFT steps from ``model_dir`` on ``rows`` and saves model + tokenizer to ``out_dir``.

    Idempotent: a directory holding a build of the same recipe (``warm_start.json``) is kept.

    Args:
        model_dir: the starting checkpoint (e.g. ``.cache/models/tiny-qwen2``).
        out_dir: where the warm-started checkpoint goes (same architecture and parameter names).
        rows: synthetic rows with ``messages`` and ``answer``.
        steps: optimizer steps (few on purpose: the skeleton must be learned only partly).
        batch_size: rows per step.
        lr: AdamW learning rate.
        seed: data order and torch seed.
        image_root: the directory relative image refs of the rows are resolved against (image rows).

    Returns:
        ``out_dir`` as an absolute path.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.policy import is_vl_checkpoint

    out_dir = Path(out_dir).resolve()
    weights = Path(model_dir) / "model.safetensors"
    recipe = {
        "recipe": WARM_START_RECIPE,
        "base": str(Path(model_dir).resolve()),
        "base_sha1": hashlib.sha1(weights.read_bytes()).hexdigest() if weights.exists() else None,
        "rows": len(rows),
        "rows_sha1": hashlib.sha1(
            json.dumps(
                [[r["messages"], r.get("images"), r["answer"]] for r in rows], ensure_ascii=False
            ).encode()
        ).hexdigest(),
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
    }
    info = out_dir / "warm_start.json"
    if info.exists() and json.loads(info.read_text()) == recipe:
        return out_dir
    torch.manual_seed(seed)
    if is_vl_checkpoint(model_dir):
        return _warm_start_vl(model_dir, out_dir, rows, recipe, image_root)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    examples = sft_examples(tokenizer, rows)
    order = list(range(len(examples)))
    rng = random.Random(seed)
    cursor = len(order)
    for step in range(steps):
        picked = []
        for _ in range(batch_size):
            if cursor >= len(order):
                rng.shuffle(order)
                cursor = 0
            picked.append(examples[order[cursor]])
            cursor += 1
        loss = model(**_batch(picked, int(tokenizer.pad_token_id))).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            logger.info("warm start step %d/%d: loss %.3f", step + 1, steps, loss.item())
    return _save(model, tokenizer, out_dir, recipe)


def _save(model: Any, processing: Any, out_dir: Path, recipe: dict[str, Any]) -> Path:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    processing.save_pretrained(tmp)
    (tmp / "warm_start.json").write_text(json.dumps(recipe, indent=1))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _warm_start_vl(
    model_dir: Path,
    out_dir: Path,
    rows: Sequence[dict[str, Any]],
    recipe: dict[str, Any],
    image_root: Path | None,
) -> Path:
    """The Qwen-VL warm start (module docstring): rows are encoded by the GRPO data loader's rules."""
    from learner.config import ModelConfig
    from learner.data.prompt_encoding import PromptEncoder
    from learner.data.records import resolve_image
    from learner.grpo.batch import CompletionRow, collate_rows, completion_logps
    from learner.grpo.data import resolve_row_images
    from learner.policy import load_policy

    policy = load_policy(
        ModelConfig(path=str(model_dir), freeze_vision=False, freeze_aligner=False), model_dir
    )
    model, tokenizer = policy.model, policy.tokenizer
    encoder = PromptEncoder.for_model(model, tokenizer, policy.processor)

    def resolve(ref: str) -> str:
        return resolve_image(ref, image_root or ".")

    eot = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    examples = []
    for row in rows:
        messages = resolve_row_images(row["messages"], row.get("images") or [], resolve)
        prompt = encoder.encode(messages)
        encoder.new_window()
        answer = tokenizer.encode(row["answer"], add_special_tokens=False) + eot
        examples.append(CompletionRow(prompt.ids, answer, None, 0.0, prompt.rope_positions, prompt.mm_inputs))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe["lr"])
    rng = random.Random(recipe["seed"])
    order: list[int] = []
    for step in range(recipe["steps"]):
        if len(order) < recipe["batch_size"]:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        picked = [examples[i] for i in order[: recipe["batch_size"]]]
        del order[: recipe["batch_size"]]
        batch = collate_rows(picked, int(tokenizer.pad_token_id))
        mask = batch["completion_mask"]
        loss = -(completion_logps(model, batch) * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == recipe["steps"] - 1:
            logger.info("warm start (VL) step %d/%d: loss %.3f", step + 1, recipe["steps"], loss.item())
    return _save(model, policy.processor, out_dir, recipe)

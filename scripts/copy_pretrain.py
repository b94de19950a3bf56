"""Generic copy pretraining of a tiny LM: the step that makes the demo learnable in ~100–150 SFT steps.

Why: the demo task (learner/demo_data/scenes.py) is "copy the scene's content tokens into the JSON answer". A
randomly initialised 2-layer model needs a copy ("induction") circuit for that, and forms it only after a long
plateau (≥ 25k samples in the SFT probe runs, docs/EXPERIMENTS.md). Pretraining the same model on GENERIC copy
data first — random token sequences, no prompts, no JSON, no scenes, nothing of the demo's answers — gives it
the circuit, as a pretrained LM would have it; SFT then only has to learn the output format.

Data (one row): ``noise + S + noise + S'`` where ``S`` is 8..seq_max distinct random "content" tokens (all
1000 coord tokens and the category words) and ``S'`` repeats ``S`` with 0..gap_max random "filler" tokens
(every other non-special token) before each element. Only the elements of ``S'`` carry labels, so the model
learns "emit the successor, in the first copy, of the last content token I emitted, whatever filler came
since". gap_max 12 matters: the answer JSON puts 2..11 structure tokens between two content tokens (gap_max 3
or 6 pretrains fine but does not transfer).

CLI: ``python scripts/copy_pretrain.py --model-dir .cache/models/tiny-qwen2 --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

CONTENT_WORDS = "cat dog car tree lamp rug sofa chair person table bird bike cup book plant".split()


@dataclass(frozen=True)
class CopyPretrainConfig:
    """Recipe. Defaults are the ones validated with sft_probe.py (8 of 8 seeds transferred).

    Attributes:
        max_steps: hard cap on optimizer steps.
        until_loss: stop once the loss EMA (0.9) is below this (0 = run max_steps).
        extra_steps: steps to keep going after ``until_loss`` is reached.
        batch: rows per step.
        lr: peak AdamW learning rate (linear warmup over ``warmup`` steps, then constant).
        warmup: warmup steps.
        gap_max: most filler tokens before an element of the second copy.
        seq_max: longest copied sequence (≥ 8).
        prefix_max: longest noise prefix (≥ 10).
        seed: RNG seed of the data stream.
    """

    max_steps: int = 2500
    until_loss: float = 0.5
    extra_steps: int = 50
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 20
    gap_max: int = 12
    seq_max: int = 40
    prefix_max: int = 60
    seed: int = 12345


def copy_vocab(tok) -> tuple[list[int], list[int]]:
    """``(content, filler)`` token ids: coord tokens + single-token category words, and everything else."""
    special = set(tok.all_special_ids)
    coord = [tok.convert_tokens_to_ids(f"<|coord_{k}|>") for k in range(1000)]
    words = []
    for w in CONTENT_WORDS:
        ids = tok.encode(w, add_special_tokens=False)
        if len(ids) == 1:
            words += ids
    taken = special | set(coord) | set(words)
    filler = [i for i in range(len(tok)) if i not in taken]
    return coord + words, filler


def make_batch(
    rng: random.Random, content: list[int], filler: list[int], cfg: CopyPretrainConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One right-padded batch ``(input_ids, labels, attention_mask)`` of copy rows (see module docstring)."""
    rows = []
    for _ in range(cfg.batch):
        ids: list[int] = [
            rng.choice(filler) for _ in range(rng.randint(min(10, cfg.prefix_max), cfg.prefix_max))
        ]
        seq = rng.sample(content, rng.randint(8, cfg.seq_max))
        ids += seq + [rng.choice(filler) for _ in range(rng.randint(1, 10))]
        labels = [-100] * len(ids)
        for t in seq:
            k = rng.randint(0, cfg.gap_max)
            ids += [rng.choice(filler) for _ in range(k)] + [t]
            labels += [-100] * k + [t]
        rows.append((ids, labels))
    n = max(len(r[0]) for r in rows)
    x = torch.zeros((cfg.batch, n), dtype=torch.long)
    y = torch.full((cfg.batch, n), -100, dtype=torch.long)
    a = torch.zeros((cfg.batch, n), dtype=torch.long)
    for i, (ids, labels) in enumerate(rows):
        x[i, : len(ids)] = torch.tensor(ids)
        y[i, : len(ids)] = torch.tensor(labels)
        a[i, : len(ids)] = 1
    return x, y, a


def copy_pretrain(
    model,
    tok,
    cfg: CopyPretrainConfig,
    device: str = "cpu",
    on_log: Callable[[dict], None] | None = None,
) -> dict:
    """Train ``model`` in place on copy data; return ``{"steps", "loss_ema", "seconds", "converged"}``.

    ``converged`` is False when ``until_loss`` was set and never reached within ``max_steps`` (the copy
    circuit did not form; SFT will then be as slow as from scratch).
    """
    content, filler = copy_vocab(tok)
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    stop_at: int | None = None
    ema = 0.0
    step = 0
    for step in range(cfg.max_steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        x, y, a = (t.to(device) for t in make_batch(rng, content, filler, cfg))
        logits = model(input_ids=x, attention_mask=a).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), y[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        ema = lv if step == 0 else 0.9 * ema + 0.1 * lv
        if stop_at is None and cfg.until_loss and ema < cfg.until_loss:
            stop_at = step + cfg.extra_steps
        last = step + 1 == cfg.max_steps or (stop_at is not None and step >= stop_at)
        if on_log and ((step + 1) % 100 == 0 or last):
            on_log(
                {
                    "pretrain_step": step + 1,
                    "loss": round(lv, 4),
                    "ema": round(ema, 4),
                    "t_s": round(time.perf_counter() - t0, 1),
                }
            )
        if last:
            break
    return {
        "steps": step + 1,
        "loss_ema": round(ema, 4),
        "seconds": round(time.perf_counter() - t0, 1),
        "converged": not cfg.until_loss or stop_at is not None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True, help="model to start from (e.g. tiny-qwen2)")
    ap.add_argument("--out", type=Path, required=True, help="where to save the pretrained model + tokenizer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    for name, default in asdict(CopyPretrainConfig()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = CopyPretrainConfig(**{k: getattr(args, k) for k in asdict(CopyPretrainConfig())})
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(args.device)
    report = copy_pretrain(model, tok, cfg, args.device, on_log=lambda d: print(json.dumps(d), flush=True))
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(json.dumps({"out": str(args.out), **report}), flush=True)
    return 0 if report["converged"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""SFT probe: can the tiny demo model learn the synthetic detection set fast enough on CPU?

Self-contained experiment (plain transformers + torch, no learner code besides the data generator). It
teacher-forces the GT answers of ``learner/data/synthetic.py`` and measures greedy held-out F1 every
``--eval-every`` optimizer steps, printing one JSON line per evaluation with the TRAINING wall time
(evaluation excluded), step, loss and F1.

- Prompt: the chat template with the default system prompt of spec/STAGE2.md §3.2 and the user prompt of §3.2
  followed by a newline and the record's ``metadata.scene``.
- Answer: the §4 JSON (``json.dumps(..., separators=(", ", ": "))``), then ``<|im_end|>``.
- ``--loss ce``: cross-entropy on every answer token and ``<|im_end|>`` (plain SFT).
  ``--loss stage2``: what the rollout-matching learner does to an appended tail (§12, §13): CE on structure
  tokens and ``<|im_end|>``, no CE on desc values unless ``--desc-ce``, the coordinate loss of §13.2
  (softCE + W1 + gate; ``--coord-sigma``, ``--coord-truncate``, ``--w1-weight``) at coord tokens,
  token-weighted ``S_ce/N_ce + S_coord/N_coord``.
- ``--pretrain-steps N`` (N = cap, e.g. 2500) first runs generic copy pretraining (copy_pretrain.py) with the
  validated recipe; ``--save-pretrained DIR`` keeps that model, ``--preset DIR`` starts from a saved one.
- ``--preset-arch JSON`` tries a model size that is not a builder preset (registered in memory only).
- Evaluation (approximate, for the probe only): HF greedy ``generate`` in left-padded batches, complete
  objects extracted by regex (truncated answers keep their complete objects), greedy one-to-one matching
  by polygon IoU (shapely). ``f1`` uses IoU ≥ 0.5, ``f1_03`` IoU ≥ 0.3 (the product gate is maskIoU 0.3).

Winning recipe (copy-pretrained ``tiny``, default prompts, grid 20):
``python scripts/experiments/sft_probe.py --preset tiny --pretrain-steps 2500 --grid 20 --batch 8 --lr 3e-3
--schedule cosine --warmup 10 --steps 250``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from copy_pretrain import CopyPretrainConfig, copy_pretrain  # noqa: E402
from probe_eval import gt_coords, match_counts, parse_objects  # noqa: E402

from learner.data.synthetic import DemoDataConfig, generate_records, scene_user_text  # noqa: E402

SYSTEM_PROMPT = (
    "You are an open-vocabulary object detector. Reply with one single-line JSON object and nothing else, "
    'shaped like {"object_1": {...}, "object_2": {...}}. Each entry has a short plain-English "desc" and '
    'exactly one geometry: "bbox_2d" as [x1, y1, x2, y2] with x1 ≤ x2 and y1 ≤ y2, or "poly" as one closed '
    "ring of [x, y] points that starts at the top-most (then left-most) vertex and goes clockwise. Write "
    "every coordinate as <|coord_N|> with N from 0 to 999. Put one space after every ':' and ','. List "
    "objects top to bottom, then left to right, numbering from 1. If nothing is visible, reply {}. Use desc "
    '"unknown" for objects you cannot name.'
)
USER_PROMPT = (
    "List every object in the image, top to bottom then left to right, as one JSON object whose entries hold "
    "a desc and one geometry written with coordinate tokens 0–999."
)
# Short prompts for the prompt-length ablation (prompts.system / prompts.user are config knobs, §3.2).
SHORT_SYSTEM_PROMPT = "You are an object detector. Reply with one JSON object."
SHORT_USER_PROMPT = "List every object."


# ----------------------------------------------------------------------------------------------- data
def answer_json(record: dict) -> str:
    """§4 answer text: keys object_1.., desc first, bbox flat / poly as [x, y] pairs of coord strings."""
    out = {}
    for i, o in enumerate(record["objects"], start=1):
        if "bbox_2d" in o:
            out[f"object_{i}"] = {"desc": o["desc"], "bbox_2d": o["bbox_2d"]}
        else:
            p = o["poly"]
            out[f"object_{i}"] = {"desc": o["desc"], "poly": [[p[j], p[j + 1]] for j in range(0, len(p), 2)]}
    return json.dumps(out, ensure_ascii=False, separators=(", ", ": "))


PROMPTS = {"system": SYSTEM_PROMPT, "user": USER_PROMPT}


def prompt_text(tok, record: dict) -> str:
    messages = [
        {"role": "system", "content": PROMPTS["system"]},
        {"role": "user", "content": scene_user_text(PROMPTS["user"], record["metadata"]["scene"])},
    ]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class Encoded:
    """One teacher-forced sample: ids, CE labels and coord supervision (positions and bins)."""

    def __init__(self, tok, record: dict, coord_bin: dict[int, int], im_end: int, desc_ce: bool, mode: str):
        p_ids = tok.encode(prompt_text(tok, record), add_special_tokens=False)
        ans = answer_json(record)
        enc = tok(ans, add_special_tokens=False, return_offsets_mapping=True)
        a_ids, offs = enc["input_ids"], enc["offset_mapping"]
        nl = tok.encode("\n", add_special_tokens=False)
        self.ids = p_ids + a_ids + [im_end] + nl
        self.prompt_len = len(p_ids)
        self.labels = [-100] * len(self.ids)
        self.coord_pos: list[int] = []
        self.coord_bins: list[int] = []
        spans = [(m.start(1), m.end(1)) for m in re.finditer(r'"desc": "([^"]*)"', ans)]
        for j, (tid, (s, e)) in enumerate(zip(a_ids, offs, strict=True)):
            pos = self.prompt_len + j
            if mode == "ce":
                self.labels[pos] = tid
            elif tid in coord_bin:
                self.coord_pos.append(pos)
                self.coord_bins.append(coord_bin[tid])
            elif desc_ce or not any(s < de and e > ds for ds, de in spans):
                self.labels[pos] = tid
        self.labels[self.prompt_len + len(a_ids)] = im_end


def collate(batch: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    n = max(len(b.ids) for b in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), n), -100, dtype=torch.long)
    att = torch.zeros((len(batch), n), dtype=torch.long)
    cb, cp, cbin = [], [], []
    for i, b in enumerate(batch):
        ids[i, : len(b.ids)] = torch.tensor(b.ids)
        lab[i, : len(b.ids)] = torch.tensor(b.labels)
        att[i, : len(b.ids)] = 1
        cb += [i] * len(b.coord_pos)
        cp += b.coord_pos
        cbin += b.coord_bins
    return {
        "input_ids": ids,
        "labels": lab,
        "attention_mask": att,
        "coord_b": torch.tensor(cb, dtype=torch.long),
        "coord_p": torch.tensor(cp, dtype=torch.long),
        "coord_bin": torch.tensor(cbin, dtype=torch.long),
    }


# ----------------------------------------------------------------------------------------------- loss
COORD_LOSS = {"sigma": 2.0, "truncate": None, "w1_weight": 1.0}


def coord_loss(z: torch.Tensor, coord_ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """§13.2 per-slot loss (softCE + w1_weight·W1 + gate, τ 1); z: [N, V] logits, t: [N] target bins."""
    sigma, trunc, w1_weight = COORD_LOSS["sigma"], COORD_LOSS["truncate"], COORD_LOSS["w1_weight"]
    z = z.float().nan_to_num(0.0, 1e4, -1e4).clamp(-1e4, 1e4)
    zc = z[:, coord_ids]
    k = torch.arange(1000, dtype=torch.float32, device=z.device)
    d = k[None, :] - t[:, None].float()
    q = torch.exp(-0.5 * (d / sigma) ** 2)
    if trunc is not None:
        q = q * (d.abs() <= trunc)
    q = q / q.sum(-1, keepdim=True)
    logp = F.log_softmax(zc, dim=-1)
    soft_ce = -(q * logp).sum(-1)
    w1 = (logp.exp().cumsum(-1) - q.cumsum(-1)).abs().sum(-1) / 999
    gate = (torch.logsumexp(z, -1) - torch.logsumexp(zc, -1)).clamp_min(0)
    return soft_ce + w1_weight * w1 + gate


def compute_loss(
    model, batch: dict[str, torch.Tensor], coord_ids: torch.Tensor
) -> tuple[torch.Tensor, float]:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lab = batch["labels"][:, 1:]
    lg = logits[:, :-1]
    mask = lab != -100
    ce = F.cross_entropy(lg[mask].float(), lab[mask], reduction="sum")
    loss = ce / mask.sum().clamp_min(1)
    if batch["coord_p"].numel():
        z = logits[batch["coord_b"], batch["coord_p"] - 1]
        loss = loss + coord_loss(z, coord_ids, batch["coord_bin"]).mean()
    return loss, float(loss.detach())


# ------------------------------------------------------------------------------------------------ eval
@torch.no_grad()
def evaluate(model, tok, records: list[dict], gen_batch: int, max_new: int, stop_ids: list[int]) -> dict:
    model.eval()
    tok.padding_side = "left"
    n_pred = n_gt = m5 = m3 = 0
    gen_times = []
    for i in range(0, len(records), gen_batch):
        chunk = records[i : i + gen_batch]
        enc = tok(
            [prompt_text(tok, r) for r in chunk], return_tensors="pt", padding=True, add_special_tokens=False
        )
        enc = enc.to(model.device)
        t0 = time.perf_counter()
        out = model.generate(
            **enc,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=stop_ids,
            pad_token_id=tok.pad_token_id,
        )
        gen_times.append(time.perf_counter() - t0)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=False)
        for r, text in zip(chunk, texts, strict=True):
            preds = [v for _, v in parse_objects(text)]
            gts = gt_coords(r)
            n_pred += len(preds)
            n_gt += len(gts)
            m5 += match_counts(preds, gts, 0.5)
            m3 += match_counts(preds, gts, 0.3)
    model.train()

    def f1(m: int) -> float:
        p, r = m / max(n_pred, 1), m / max(n_gt, 1)
        return 2 * p * r / (p + r) if p + r else 0.0

    return {
        "f1": round(f1(m5), 4),
        "f1_03": round(f1(m3), 4),
        "pred": n_pred,
        "gt": n_gt,
        "matched": m5,
        "gen_s_per_batch": round(sum(gen_times) / len(gen_times), 3),
        "sample": texts[0][:200],
    }


# ------------------------------------------------------------------------------------------------ main
def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.schedule == "constant":
        return args.lr
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    if args.schedule == "linear":
        return args.lr * (1 - frac * (1 - args.min_lr_ratio))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", help="builder preset (tiny, demo) or a model directory")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument(
        "--preset-arch",
        default="",
        help='JSON Qwen2 sizes for an experimental preset, e.g. {"hidden_size": 192, ...}; overrides --preset',
    )
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--schedule", choices=["constant", "cosine", "linear"], default="cosine")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=0, help="0 = longest eval answer + 16")
    ap.add_argument("--grid", type=int, default=20)
    ap.add_argument("--max-objects", type=int, default=6)
    ap.add_argument("--scene-style", choices=["tight", "compact", "verbose"], default="tight")
    ap.add_argument("--no-distinct", action="store_true", help="allow repeated coordinate values and descs")
    ap.add_argument("--system-prompt", choices=["default", "short"], default="default")
    ap.add_argument("--user-prompt", choices=["default", "short"], default="default")
    ap.add_argument("--loss", choices=["ce", "stage2"], default="ce")
    ap.add_argument("--desc-ce", action="store_true", help="stage2 loss: CE on desc values too (fn_desc_ce)")
    ap.add_argument("--coord-sigma", type=float, default=2.0, help="stage2 loss: coord_loss.target_sigma")
    ap.add_argument("--coord-truncate", type=int, default=-1, help="stage2 loss: target_truncate (-1 = null)")
    ap.add_argument("--w1-weight", type=float, default=1.0, help="stage2 loss: coord_loss.w1_weight")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--max-train-s", type=float, default=0.0, help="stop after this much training time (0 = off)"
    )
    ap.add_argument(
        "--pretrain-steps", type=int, default=0, help="copy pretraining (copy_pretrain.py) step cap; 0 = off"
    )
    ap.add_argument("--pretrain-batch", type=int, default=32)
    ap.add_argument("--pretrain-lr", type=float, default=3e-3)
    ap.add_argument("--pretrain-filler-max", type=int, default=12, help="copy_pretrain gap_max")
    ap.add_argument("--pretrain-until-loss", type=float, default=0.5, help="stop once the loss EMA is below")
    ap.add_argument("--pretrain-extra", type=int, default=50, help="steps to keep pretraining after that")
    ap.add_argument("--pretrain-seq-max", type=int, default=40, help="longest copied sequence")
    ap.add_argument("--pretrain-prefix-max", type=int, default=60, help="longest noise prefix")
    ap.add_argument("--save-pretrained", default="", help="save the copy-pretrained model here")
    ap.add_argument("--gen-timing", action="store_true", help="time one 16-prompt greedy batch at the end")
    args = ap.parse_args(argv)

    COORD_LOSS.update(
        sigma=args.coord_sigma,
        truncate=None if args.coord_truncate < 0 else args.coord_truncate,
        w1_weight=args.w1_weight,
    )
    if args.system_prompt == "short":
        PROMPTS["system"] = SHORT_SYSTEM_PROMPT
    if args.user_prompt == "short":
        PROMPTS["user"] = SHORT_USER_PROMPT
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(args.preset)
    if args.preset_arch:
        import hashlib

        import build_tiny_models

        arch = json.loads(args.preset_arch)
        args.preset = "probe-" + hashlib.sha1(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:8]
        build_tiny_models.PRESETS[args.preset] = arch  # experiment only; real presets live in the builder
        model_dir = Path(args.preset)
    if not model_dir.is_dir():
        from build_tiny_models import build_tiny_lm

        name = "tiny-qwen2" if args.preset == "tiny" else f"tiny-qwen2-{args.preset}"
        if args.model_seed:
            name += f"-seed{args.model_seed}"
        model_dir = build_tiny_lm(REPO / ".cache" / "models" / name, seed=args.model_seed, preset=args.preset)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    if args.pretrain_steps:
        pcfg = CopyPretrainConfig(
            max_steps=args.pretrain_steps,
            until_loss=args.pretrain_until_loss,
            extra_steps=args.pretrain_extra,
            batch=args.pretrain_batch,
            lr=args.pretrain_lr,
            gap_max=args.pretrain_filler_max,
            seq_max=args.pretrain_seq_max,
            prefix_max=args.pretrain_prefix_max,
            seed=args.seed + 12345,
        )
        rep = copy_pretrain(model, tok, pcfg, args.device, on_log=lambda d: print(json.dumps(d), flush=True))
        print(json.dumps({"pretrain_report": rep}), flush=True)
        if args.save_pretrained:
            model.save_pretrained(args.save_pretrained)
            tok.save_pretrained(args.save_pretrained)

    cfg = DemoDataConfig(
        grid=args.grid,
        max_objects=args.max_objects,
        scene_style=args.scene_style,
        distinct=not args.no_distinct,
    )
    train = generate_records(args.n_train, args.data_seed, "train", cfg)
    held = generate_records(args.n_eval, args.data_seed, "eval", cfg)
    coord_ids_list = tok.convert_tokens_to_ids([f"<|coord_{k}|>" for k in range(1000)])
    coord_bin = {cid: k for k, cid in enumerate(coord_ids_list)}
    coord_ids = torch.tensor(coord_ids_list, device=args.device)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    stop_ids = [im_end, tok.convert_tokens_to_ids("<|endoftext|>")]
    t0 = time.perf_counter()
    enc = [Encoded(tok, r, coord_bin, im_end, args.desc_ce, args.loss) for r in train]
    t_enc = time.perf_counter() - t0
    max_new = args.max_new or max(len(tok.encode(answer_json(r))) for r in held) + 16
    mean_len = sum(len(e.ids) for e in enc) / len(enc)
    print(
        json.dumps(
            {
                "config": vars(args),
                "params": n_params,
                "mean_seq_len": round(mean_len, 1),
                "encode_s": round(t_enc, 2),
                "max_new": max_new,
            }
        ),
        flush=True,
    )

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    order: list[int] = []
    train_s = 0.0
    losses: list[float] = []
    history = []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            ev = evaluate(model, tok, held, args.gen_batch, max_new, stop_ids)
            row = {
                "t_train_s": round(train_s, 1),
                "step": step,
                "loss": round(sum(losses) / len(losses), 4) if losses else None,
                "steps_per_s": round(step / train_s, 3) if train_s else None,
                **ev,
            }
            history.append(row)
            print(json.dumps(row), flush=True)
            losses = []
        if step == args.steps or (args.max_train_s and train_s > args.max_train_s):
            break
        t1 = time.perf_counter()
        if len(order) < args.batch:
            perm = list(range(len(enc)))
            rng.shuffle(perm)
            order += perm
        idx, order = order[: args.batch], order[args.batch :]
        batch = {k: v.to(args.device) for k, v in collate([enc[i] for i in idx], tok.pad_token_id).items()}
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        loss, lv = compute_loss(model, batch, coord_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(lv)
        train_s += time.perf_counter() - t1

    if args.gen_timing:
        model.eval()
        tok.padding_side = "left"
        texts = [prompt_text(tok, r) for r in held[:16]]
        enc16 = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(args.device)
        times = []
        for _ in range(2):
            t1 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    **enc16,
                    max_new_tokens=max_new,
                    do_sample=False,
                    eos_token_id=stop_ids,
                    pad_token_id=tok.pad_token_id,
                )
            times.append(time.perf_counter() - t1)
        print(
            json.dumps(
                {
                    "gen16_s": [round(t, 3) for t in times],
                    "gen16_new_tokens_max": out.shape[1] - enc16["input_ids"].shape[1],
                }
            ),
            flush=True,
        )
    best = max(history, key=lambda h: h["f1"])
    print(
        json.dumps({"final_f1": history[-1]["f1"], "best_f1": best["f1"], "best_step": best["step"]}),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compact logits vs full logits: peak memory and time of one stage-2 training micro-step, measured in one run.

`stage2.loss.compact_logits` (default on) asks the model for logits only at the columns the losses read
(`learner.stage2.losses.read_columns`: `t - 1` for every labelled `t`, `p - 1` for every coord slot). A
rollout-matching sample is mostly prompt (image tokens plus text) that no loss reads, and a Qwen vocabulary
has 151,936 entries, so the full `[B, T, V]` logits and their gradient dominate a step's activation memory.

Set-up (nothing is downloaded): a random-init Qwen2-0.5B-shaped causal LM (hidden 896, 24 layers, 14 heads /
2 KV heads, MLP 4864, vocabulary 151,936, tied head) in bf16; samples of `--prompt` prompt tokens followed by
`--answer` supervised answer tokens, every 5th answer token a coord slot; two layouts: one packed row of
`--packed-tokens` tokens (segments cut to fit) and a right-padded batch of `--padded-rows` samples. Per
layout and mode: fwd + loss + bwd, median of `--repeats` timed steps after one untimed step, and the peak
memory allocated during a step above what was allocated before it (`torch.cuda.max_memory_allocated`).
Losses of the two modes are printed too (they must agree).

    python bench/bench_logits.py            # CUDA machine
    python bench/bench_logits.py --smoke    # embedded tiny model on CPU (seconds; no memory figures)

Prints one JSON line per (layout, mode) and one ratio line per layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from learner.stage2.losses import CoordLossConfig, micro_loss, read_columns, step_loss_sums  # noqa: E402
from learner.trainers.rollout_matching import forward_for_loss  # noqa: E402

IGNORE = -100


@dataclass
class Batch:
    """What the model and `step_loss_sums` read (the `PackedBatch` fields this bench needs)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    labels: torch.Tensor
    coord_batch_idx: torch.Tensor
    coord_pos: torch.Tensor
    coord_bins: torch.Tensor
    coord_is_prefix: torch.Tensor

    def model_inputs(self) -> dict[str, torch.Tensor | bool]:
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        return out


def make_batch(
    rows: list[list[tuple[int, int]]], vocab: int, coord_ids: torch.Tensor, device: str, padded: bool
) -> Batch:
    """`rows[b]` lists `(prompt_len, answer_len)` segments laid end to end in row `b` (right padding)."""
    gen = torch.Generator().manual_seed(0)
    width = max(sum(p + a for p, a in row) for row in rows)
    ids = torch.randint(0, vocab - 1000, (len(rows), width), generator=gen)
    labels = torch.full_like(ids, IGNORE)
    positions = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    coord_b, coord_p = [], []
    for b, row in enumerate(rows):
        start = 0
        for prompt, answer in row:
            end = start + prompt + answer
            positions[b, start:end] = torch.arange(prompt + answer)
            mask[b, start:end] = 1
            for t in range(start + prompt, end):
                if (t - start - prompt) % 5 == 4:
                    ids[b, t] = coord_ids[(7 * t) % 1000]
                    coord_b.append(b)
                    coord_p.append(t)
                else:
                    labels[b, t] = ids[b, t]
            start = end
    k = len(coord_p)
    return Batch(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        attention_mask=mask.to(device) if padded else None,
        labels=labels.to(device),
        coord_batch_idx=torch.tensor(coord_b, device=device),
        coord_pos=torch.tensor(coord_p, device=device),
        coord_bins=torch.tensor([(7 * p) % 1000 for p in coord_p], device=device),
        coord_is_prefix=torch.zeros(k, dtype=torch.bool, device=device),
    )


def build_model(smoke: bool, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if smoke:
        sys.path.insert(0, str(REPO / "scripts"))
        from build_tiny_models import build_tiny_lm

        path = build_tiny_lm(REPO / ".cache" / "models" / "tiny-qwen2", seed=0)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).train()
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable()
    return model.train()


def step(model: torch.nn.Module, batch: Batch, coord_ids: torch.Tensor, compact: bool) -> float:
    outputs, columns = forward_for_loss(model, batch, compact=compact)
    sums = step_loss_sums(
        outputs.logits, batch, coord_ids=coord_ids, coord_cfg=CoordLossConfig(), eos_id=None, columns=columns
    )
    loss = micro_loss(sums, sums.n_ce, sums.n_coord, 1, "token_weighted", 1)
    loss.backward()
    return float(loss.detach())


def measure(model, batch, coord_ids, compact: bool, repeats: int, cuda: bool) -> dict[str, float]:
    model.zero_grad(set_to_none=False)
    loss = step(model, batch, coord_ids, compact)  # untimed: kernels, allocator
    times, peaks = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        step(model, batch, coord_ids, compact)
        if cuda:
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**30)
        times.append(time.perf_counter() - started)
    out = {"loss": round(loss, 5), "step_s": round(statistics.median(times), 4)}
    if cuda:
        out["peak_step_gib"] = round(max(peaks), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, short samples")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens per sample (default 1536)")
    parser.add_argument("--answer", type=int, default=None, help="answer tokens per sample (default 512)")
    parser.add_argument("--packed-tokens", type=int, default=None, help="packed row length (default 16384)")
    parser.add_argument("--padded-rows", type=int, default=None, help="padded batch rows (default 4)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        parser.error("the full benchmark needs a CUDA device; use --smoke on CPU")
    device = "cuda" if cuda else "cpu"
    prompt = args.prompt or (96 if args.smoke else 1536)
    answer = args.answer or (32 if args.smoke else 512)
    packed_tokens = args.packed_tokens or (1024 if args.smoke else 16384)
    padded_rows = args.padded_rows or 4
    model = build_model(args.smoke, device)
    vocab = model.get_output_embeddings().weight.shape[0]
    coord_ids = torch.arange(vocab - 1000, vocab, device=device)
    per_row = packed_tokens // (prompt + answer)
    # Padded rows differ in length (every row's prompt a bit shorter than the last), as real batches do.
    layouts = {
        "packed": make_batch([[(prompt, answer)] * per_row], vocab, coord_ids, device, padded=False),
        "padded": make_batch(
            [[(prompt - prompt // 8 * i, answer)] for i in range(padded_rows)],
            vocab,
            coord_ids,
            device,
            padded=True,
        ),
    }
    common = {
        "bench": "compact_logits",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": vocab,
        "prompt_tokens": prompt,
        "answer_tokens": answer,
    }
    for name, batch in layouts.items():
        read = int(read_columns(batch.labels, batch.coord_pos).numel())
        shape = list(batch.input_ids.shape)
        results = {}
        for mode, compact in (("full", False), ("compact", True)):
            results[mode] = measure(model, batch, coord_ids, compact, args.repeats, cuda)
            print(
                json.dumps(
                    {
                        **common,
                        "layout": name,
                        "shape": shape,
                        "read_columns": read,
                        "mode": mode,
                        **results[mode],
                    }
                ),
                flush=True,
            )
        ratio = {
            "step_time_full_over_compact": round(results["full"]["step_s"] / results["compact"]["step_s"], 3)
        }
        if cuda:
            ratio["peak_memory_full_over_compact"] = round(
                results["full"]["peak_step_gib"] / results["compact"]["peak_step_gib"], 3
            )
        print(
            json.dumps(
                {
                    **common,
                    "layout": name,
                    "measure": "full_over_compact",
                    **ratio,
                    "loss_abs_diff": abs(results["full"]["loss"] - results["compact"]["loss"]),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compact vs full logits: peak memory and time of one stage-2 training micro-step, measured in one run.

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

`--vlm`: the same two modes on image segments built by the learner's own path (`bench/_vlm.py`): a random-init
Qwen3-VL-2B-shaped model in bf16 (tiny Qwen3-VL in float32 with `--smoke`; gradient checkpointing only with
`--gradient-checkpointing`), image prompts of 448–896 px (196–784 image tokens) through `PromptEncoder`,
answers of 50–600 tokens through `build_segment`, laid out by `pack_segments` (segments in order while they
fit `--packed-tokens`, default 8192) and `pad_segments` (`--padded-rows` segments).

    python bench/bench_logits.py            # CUDA machine
    python bench/bench_logits.py --smoke    # embedded tiny model on CPU (seconds; no memory figures)
    python bench/bench_logits.py --vlm      # image segments, Qwen3-VL-2B shapes (CUDA)

Prints one JSON line per (layout, mode) and one ratio line per layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from learner.kernels import packed_attention  # noqa: E402
from learner.stage2.losses import LossConfig, read_columns  # noqa: E402
from learner.stage2.step import micro_step_loss  # noqa: E402

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
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    fp_batch_idx: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    fp_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    fp_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def model_inputs(self, *, flash_varlen_kwargs: bool = False) -> dict[str, torch.Tensor | bool | int]:
        out: dict[str, torch.Tensor | bool | int] = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "use_cache": False,
        }
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        if flash_varlen_kwargs and self.cu_seqlens is not None:  # packed row: segment bounds, as PackedBatch
            out |= {
                "cu_seq_lens_q": self.cu_seqlens,
                "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_seqlen,
                "max_length_k": self.max_seqlen,
            }
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
    bounds = [0]
    for prompt, answer in rows[0]:
        bounds.append(bounds[-1] + prompt + answer)
    return Batch(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        attention_mask=mask.to(device) if padded else None,
        labels=labels.to(device),
        coord_batch_idx=torch.tensor(coord_b, device=device),
        coord_pos=torch.tensor(coord_p, device=device),
        coord_bins=torch.tensor([(7 * p) % 1000 for p in coord_p], device=device),
        coord_is_prefix=torch.zeros(k, dtype=torch.bool, device=device),
        cu_seqlens=None if padded else torch.tensor(bounds, dtype=torch.int32, device=device),
        max_seqlen=max(p + a for row in rows for p, a in row),
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


def step(
    model: torch.nn.Module, batch: Batch, coord_ids: torch.Tensor, compact: bool, eos_id: int | None
) -> float:
    with packed_attention(model):  # forward and backward, as the trainer's training_step
        loss = micro_step_loss(
            model, batch, coord_ids=coord_ids, eos_id=eos_id, loss_cfg=LossConfig(compact_logits=compact)
        ).loss
        loss.backward()
    return float(loss.detach())


def measure(
    model, batch, coord_ids, compact: bool, repeats: int, cuda: bool, eos_id: int | None = None
) -> dict[str, float]:
    model.zero_grad(set_to_none=False)
    loss = step(model, batch, coord_ids, compact, eos_id)  # untimed: kernels, allocator
    times, peaks = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        step(model, batch, coord_ids, compact, eos_id)
        if cuda:
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**30)
        times.append(time.perf_counter() - started)
    out = {"loss": round(loss, 5), "step_s": round(statistics.median(times), 4)}
    if cuda:
        out["peak_step_gib"] = round(max(peaks), 3)
    return out


def text_layouts(
    args: argparse.Namespace, device: str
) -> tuple[torch.nn.Module, dict, dict, torch.Tensor, None]:
    """Qwen2 model and the two layouts of random text samples; common JSON fields."""
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
    return model, layouts, {"prompt_tokens": prompt, "answer_tokens": answer}, coord_ids, None


def vlm_layouts(
    args: argparse.Namespace, device: str
) -> tuple[torch.nn.Module, dict, dict, torch.Tensor, int]:
    """Qwen3-VL model and the two layouts of image segments (learner path); common JSON fields."""
    import random
    import tempfile

    from _vlm import build_vlm, forward_attention, image_messages, image_segment, image_sizes, write_images

    from learner.batching.packing import pack_segments, pad_segments

    parts = build_vlm(args.smoke, device, train=True, gradient_checkpointing=args.gradient_checkpointing)
    sizes = image_sizes(args.smoke)
    paths = write_images(Path(tempfile.mkdtemp(prefix="bench_logits_images_")), sizes)
    rng = random.Random(0)
    lo, hi = (20, 80) if args.smoke else (50, 600)
    cap = args.packed_tokens or (1024 if args.smoke else 8192)
    segments, total, k = [], 0, 0
    while True:
        prompt = parts.encoder.encode(image_messages(paths[k % len(paths)]), index=k)
        seg = image_segment(parts, prompt, rng.randint(lo, hi), rng, k)
        if total + seg.meta.encoded_len > cap:
            break
        segments.append(seg)
        total += seg.meta.encoded_len
        k += 1
    rows = args.padded_rows or 4
    layouts = {
        "packed": pack_segments(segments).to(device),
        "padded": pad_segments(segments[:rows], 0).to(device),
    }
    image_tokens = [s.input_ids.count(parts.image_token_id) for s in segments]
    common = {
        "model": "qwen3_vl",
        "attn": forward_attention(parts.model),
        "image_tokens_per_segment": [min(image_tokens), max(image_tokens)],
        "answer_tokens_range": [lo, hi],
        "segments_packed": len(segments),
    }
    coord_ids = torch.tensor(parts.coords.ids, device=device)
    return parts.model, layouts, common, coord_ids, parts.eot_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, short samples")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens per sample (default 1536)")
    parser.add_argument("--answer", type=int, default=None, help="answer tokens per sample (default 512)")
    parser.add_argument("--packed-tokens", type=int, default=None, help="packed row length (default 16384)")
    parser.add_argument("--padded-rows", type=int, default=None, help="padded batch rows (default 4)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vlm", action="store_true", help="Qwen3-VL on image segments (see above)")
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="--vlm: turn gradient checkpointing on (default off)",
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        parser.error("the full benchmark needs a CUDA device; use --smoke on CPU")
    device = "cuda" if cuda else "cpu"
    if args.vlm:
        model, layouts, extra, coord_ids, eos_id = vlm_layouts(args, device)
    else:
        model, layouts, extra, coord_ids, eos_id = text_layouts(args, device)
    common = {
        "bench": "compact_logits",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": model.get_output_embeddings().weight.shape[0],
        **extra,
    }
    for name, batch in layouts.items():
        read = int(read_columns(batch.labels, batch.coord_pos).numel())
        shape = list(batch.input_ids.shape)
        results = {}
        for mode, compact in (("full", False), ("compact", True)):
            try:
                results[mode] = measure(model, batch, coord_ids, compact, args.repeats, cuda, eos_id)
            except torch.OutOfMemoryError:  # a result too: this mode does not fit the device
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                results[mode] = {"out_of_memory": True}
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
        if any("out_of_memory" in r for r in results.values()):
            print(
                json.dumps({**common, "layout": name, "measure": "full_over_compact", **results}), flush=True
            )
            continue
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

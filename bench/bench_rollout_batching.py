"""HF-backend rollout batching benchmark: the learner's own path (`ColocateRolloutSource`, backend `hf`).

The same 32 chat prompts are rolled out twice with the training model itself, each row forced to exactly
`--new-tokens` new tokens (`ignore_eos`): once in left-padded batches of `rollout_generate_batch_size = 32`,
once per sample (batch size 1). Both timings and their ratio are printed as JSON lines (measured in one
process; batched: median of 3 after one untimed pass, the steady state of a training run). Target on an H100:
ratio >= 30 (decoding a ~0.4B model is launch bound, so one batched step costs about what one single-row step
costs: the ratio is `32 x` single-row step time / batched step time, both printed as `ms_per_decode_step`).

Model: a random-init ~0.4B Qwen2-architecture causal LM built from `Qwen2Config` (hidden 1024, 30 layers,
16 heads / 4 KV heads, MLP 3584) in bf16 on the GPU — nothing is downloaded; its vocabulary is the embedded
tiny tokenizer's (built offline by `scripts/build_tiny_models.py`), which also supplies the chat template.
`--smoke` uses the embedded tiny model on CPU in float32 with fewer prompts and tokens (seconds).

`--vlm`: IMAGE rollouts. The model is a random-init Qwen3-VL-2B-shaped model in bf16 (`bench/_vlm.py`; with
`--smoke` the tiny Qwen3-VL in float32), each prompt one image of 448–896 px (196–784 image tokens, sizes
cycled), encoded by the learner's `PromptEncoder` (given to `HfColocateBackend` as `encoder=`): the decode
loop prefills the vision rows and decodes with M-RoPE positions. Encodings are cached by the encoder after the
untimed pass (as within a rollout window), so the timings are the decode loop's, not the processor's. A 2B
model decodes one row in ~30 ms a step, so per-sample decoding is timed on `--per-sample-prompts` prompts
spread over the image sizes (default 8 with `--vlm`) and scaled to all prompts (`seconds` is the scaled
figure, `measured_seconds` / `measured_prompts` what ran). Target: ratio >= 20.

Examples::

    python bench/bench_rollout_batching.py            # on a CUDA machine (~0.4B, bf16)
    python bench/bench_rollout_batching.py --smoke    # tiny model on CPU
    python bench/bench_rollout_batching.py --vlm      # image prompts, Qwen3-VL-2B shapes (CUDA)
    python bench/bench_rollout_batching.py --vlm --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from learner.rollout.colocate import ColocateRolloutSource  # noqa: E402
from learner.rollout.colocate.hf import HfColocateBackend  # noqa: E402
from shared_schemas.infer import InferBatch, InferRequest, InferResult, RequestConfig  # noqa: E402

SYSTEM = "You are an open-vocabulary object detector. Reply with one single-line JSON object."
OBJECTS = ["lamp", "dog", "chair", "tree", "person", "car", "cup", "book"]


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def prompts(n: int) -> list[list[dict[str, str]]]:
    """`n` chat prompts of different lengths (left padding is exercised)."""
    out = []
    for i in range(n):
        scene = ", ".join(OBJECTS[(i + k) % len(OBJECTS)] for k in range(1 + i % 7))
        out.append(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Scene {i}: {scene}."}]
        )
    return out


def vlm_setup(args: argparse.Namespace, n: int) -> tuple[torch.nn.Module, object, object, list]:
    """Qwen3-VL model, tokenizer, prompt encoder and `n` image prompts (sizes cycled, texts varied)."""
    import tempfile

    from _vlm import build_vlm, image_messages, image_sizes, write_images

    parts = build_vlm(args.smoke, args.device, train=False)
    folder = Path(tempfile.mkdtemp(prefix="bench_rollout_images_"))
    paths = write_images(folder, image_sizes(args.smoke))
    messages = [
        image_messages(paths[i % len(paths)], f"Scene {i}: list every {OBJECTS[i % len(OBJECTS)]} and more.")
        for i in range(n)
    ]
    return parts.model, parts.tokenizer, parts.encoder, messages


def build_model(args: argparse.Namespace, tokenizer_dir: Path) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if args.smoke:
        model = AutoModelForCausalLM.from_pretrained(tokenizer_dir, dtype=torch.float32)
        return model.to(args.device).eval(), tokenizer
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return model.eval(), tokenizer


def plain_decode_sdpa(model: torch.nn.Module, device: str) -> None:
    """`--decode-attention plain-sdpa`: the decode loop's grouped GQA attention (`GROUPED_DECODE_SDPA`) is
    transformers' own `sdpa_attention_forward` from now on in this process (`repeat_kv`, then SDPA), with the
    same mask builder and decode mask, so the A/B differs in the attention function only. The product
    registers its function on the first decode; one empty decode block makes it do so now, and the
    registration here then replaces it."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rollout_server.engines.decode_attention import GROUPED_DECODE_SDPA, decode_attention

    with decode_attention(model, torch.device(device)):
        pass
    AttentionInterface.register(GROUPED_DECODE_SDPA, sdpa_attention_forward)


def run(source: ColocateRolloutSource, batch: InferBatch, device: str) -> tuple[float, list[InferResult]]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = source.infer(batch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, 8 prompts x 16 tokens")
    parser.add_argument("--prompts", type=int, default=None, help="prompts (default 32; smoke 8)")
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="forced new tokens (default 128; smoke 16)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="batched rollout_generate_batch_size (= prompts)"
    )
    parser.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    parser.add_argument(
        "--reference-generate",
        action="store_true",
        help="also time plain `model.generate` (batched vs per-sample, same prompts and protocol)"
        " as a reference",
    )
    parser.add_argument(
        "--decode-attention",
        choices=["grouped", "plain-sdpa"],
        default="grouped",
        help="plain-sdpa: turn the grouped GQA decode attention off (transformers' sdpa with repeat_kv), "
        "for an A/B on one machine",
    )
    parser.add_argument("--vlm", action="store_true", help="image prompts on a Qwen3-VL model (see above)")
    parser.add_argument(
        "--per-sample-prompts",
        type=int,
        default=None,
        help="per-sample decoding timed on this many prompts, spread evenly, and scaled to all (default: "
        "all; --vlm: 8)",
    )
    args = parser.parse_args(argv)
    n = args.prompts or (8 if args.smoke else 32)
    new_tokens = args.new_tokens or (16 if args.smoke else 128)
    batch_size = args.batch_size or n
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if not args.smoke and not args.device.startswith("cuda"):
        parser.error("the full benchmark needs a CUDA device; use --smoke on CPU")
    if args.vlm and args.reference_generate:
        parser.error("--reference-generate times text prompts only")

    if args.vlm:
        model, tokenizer, encoder, messages = vlm_setup(args, n)
    else:
        from build_tiny_models import build_tiny_lm

        tiny_dir = build_tiny_lm(REPO / ".cache" / "models" / "tiny-qwen2", seed=0)
        model, tokenizer = build_model(args, tiny_dir)
        encoder, messages = None, prompts(n)
    attn_implementation = model.config._attn_implementation
    if args.decode_attention == "plain-sdpa":
        plain_decode_sdpa(model, args.device)
    params = sum(p.numel() for p in model.parameters())
    batch = InferBatch(
        infer_requests=[InferRequest(messages=m, request_id=f"r{i}") for i, m in enumerate(messages)],
        # ignore_eos + min_tokens: every row decodes exactly `new_tokens` tokens in both modes.
        request_config=RequestConfig(
            max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=0.0
        ),
        seeds=list(range(n)),
    )
    batched = ColocateRolloutSource(
        HfColocateBackend(model, tokenizer, batch_size=batch_size, encoder=encoder)
    )
    single = ColocateRolloutSource(HfColocateBackend(model, tokenizer, batch_size=1, encoder=encoder))
    # Steady state, as in training (a rollout of the same batch shape every step): one untimed batched pass
    # over the whole batch, then the median of three timed ones. Per-sample decoding is timed once over all
    # `n` prompts (it repeats the same single-row shapes `n` times, so it warms itself after two prompts), or
    # over `--per-sample-prompts` of them spread evenly, scaled to `n`.
    run(batched, batch, args.device)
    run(single, batch.slice(0, min(2, n)), args.device)
    timed = sorted((run(batched, batch, args.device) for _ in range(3)), key=lambda tr: tr[0])
    t_batched, r_batched = timed[1]
    k = min(n, args.per_sample_prompts or (8 if args.vlm and not args.smoke else n))
    # Spread over the prompts AND over the image sizes they cycle through (every (n/k + 1)-th prompt).
    picked = list(range(n)) if k == n else sorted({(i * (n // k) + i) % n for i in range(k)})
    k = len(picked)
    t_measured, r_single = 0.0, []
    for i in picked:
        seconds, results = run(single, batch.slice(i, i + 1), args.device)
        t_measured += seconds
        r_single += results
    t_single = t_measured * n / k
    r_batched_picked = [r_batched[i] for i in picked]
    for results in (r_batched, r_single):
        lengths = {len(r.choices[0].token_ids) for r in results}
        if lengths != {new_tokens}:
            raise RuntimeError(
                f"expected exactly {new_tokens} new tokens per row, got lengths {sorted(lengths)}"
            )
    same = sum(
        a.choices[0].token_ids == b.choices[0].token_ids
        for a, b in zip(r_batched_picked, r_single, strict=True)
    )
    common = {
        "bench": "rollout_batching",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "params": params,
        "prompts": n,
        "new_tokens": new_tokens,
        "attn_implementation": attn_implementation,
        "decode_attention": args.decode_attention,
    }
    if args.vlm:
        image_id = model.config.image_token_id
        image_tokens = [r.prompt_token_ids.count(image_id) for r in r_batched]
        common |= {
            "model": "qwen3_vl",
            "image_tokens_min": min(image_tokens),
            "image_tokens_max": max(image_tokens),
            "prompt_len_mean": round(sum(len(r.prompt_token_ids) for r in r_batched) / n),
            "per_sample_prompt_len_mean": round(sum(len(r.prompt_token_ids) for r in r_single) / k),
        }
    tokens = n * new_tokens
    emit(
        **common,
        mode="batched",
        rollout_generate_batch_size=batch_size,
        seconds=round(t_batched, 4),
        ms_per_decode_step=round(t_batched / new_tokens * 1e3, 2),
        tokens_per_s=round(tokens / t_batched, 1),
    )
    emit(
        **common,
        mode="per_sample",
        rollout_generate_batch_size=1,
        seconds=round(t_single, 4),
        measured_prompts=k,
        measured_seconds=round(t_measured, 4),
        ms_per_decode_step=round(t_single / (n * new_tokens) * 1e3, 2),
        tokens_per_s=round(tokens / t_single, 1),
    )
    emit(
        **common,
        measure="speedup_batched_over_per_sample",
        ratio=round(t_single / t_batched, 2),
        target=20.0 if args.vlm else 30.0,
        greedy_rows_identical=f"{same}/{k}",
    )
    if args.reference_generate:
        prompt_ids = [r.prompt_token_ids for r in r_batched]
        t_ref_batched, t_ref_single = time_generate(model, tokenizer, prompt_ids, new_tokens, args.device)
        emit(
            **common,
            measure="reference_transformers_generate",
            batched_seconds=round(t_ref_batched, 4),
            per_sample_seconds=round(t_ref_single, 4),
            ratio=round(t_ref_single / t_ref_batched, 2),
            ours_over_generate_batched_speed=round(t_ref_batched / t_batched, 2),
        )
    return 0


def time_generate(
    model: torch.nn.Module, tokenizer: object, prompt_ids: list[list[int]], new_tokens: int, device: str
) -> tuple[float, float]:
    """Plain greedy `model.generate` on the same prompt ids: batched (left-padded; median of 3 after one
    untimed pass) and per sample (once over all prompts), each row forced to `new_tokens` tokens."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(rows: list[list[int]]) -> float:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - started

    generate(prompt_ids)
    generate(prompt_ids[:1])
    batched = sorted(generate(prompt_ids) for _ in range(3))[1]
    single = sum(generate([row]) for row in prompt_ids)
    return batched, single


if __name__ == "__main__":
    sys.exit(main())

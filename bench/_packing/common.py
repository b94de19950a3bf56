"""What the packing measurements share: JSON lines, segment streams, the models, rows packed as in training,
the learner's step and its timing, interleaved A/B rounds and the guard around diagnostic phases."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from learner.batching.packing import CarryBuffer, pack_segments
from learner.flops import FlopModel
from learner.kernels import index_deepstack, packed_attention, varlen_kernel
from learner.stage2.coords import CoordVocab
from learner.stage2.losses import LossConfig
from learner.stage2.step import micro_step_loss
from learner.stage2.targets.labels import build_labels
from learner.stage2.targets.segment import Segment, SegmentMeta


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def lognormal_lengths(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> Iterator[int]:
    """Endless log-normal lengths with the given mean, clipped to ``[lo, hi]``."""
    mu = math.log(mean) - sigma**2 / 2
    while True:
        yield max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


def make_segment(rng: random.Random, length: int, vocab_size: int, coords: CoordVocab, sid: int) -> Segment:
    """Random teacher-forced segment: ~30% prompt, Y_train with a coord token every 6th position."""
    eot, newline = 2, 3
    prompt_len = max(1, int(length * 0.3))
    train_len = length - prompt_len - 2
    text_hi = min(coords.ids) - 1
    prompt = [rng.randrange(10, text_hi) for _ in range(prompt_len)]
    y = [
        coords.ids[rng.randrange(1000)] if i % 6 == 5 else rng.randrange(10, text_hi)
        for i in range(train_len)
    ]
    prefix_len = train_len // 2
    slots = [i for i in range(prefix_len) if coords.is_coord(y[i])]
    targets = [coords.bin_of(y[i]) for i in slots]
    ids = prompt + y + [eot, newline]
    lab = build_labels(ids, prompt_len, prefix_len, train_len, slots, targets, [], [], coords)
    meta = SegmentMeta(sid, sid, len(ids), prompt_len, tuple(prompt), prefix_len, train_len, tuple(slots),
                       tuple(targets), (), (), 0)  # fmt: skip
    return Segment(tuple(ids), tuple(lab.labels), tuple(lab.coord_pos), tuple(lab.coord_bins),
                   tuple(lab.coord_is_prefix), meta)  # fmt: skip


def pick_attn(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if device.type == "cuda":
        return "flex_attention"
    return "sdpa"


def build_model(smoke: bool, attn: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if smoke:
        cfg = Qwen2Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          max_position_embeddings=4096)  # fmt: skip
    else:  # Qwen2.5-0.5B shapes (~0.49B parameters with tied embeddings)
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                          rope_theta=1000000.0, tie_word_embeddings=True)  # fmt: skip
    cfg.use_cache = False
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)
    model.train()
    return model


def pack_stream(new_segment: Callable[[], Segment], cap: int, packing_buffer: int, n_packs: int):
    """One segment stream packed as in training: the carry buffer fed until it holds ≥ one row of tokens, then
    one ``select_segments`` row per micro-step. Returns ``(packed batches, segments in row order, fills)``;
    the padded run takes the same segments in the same order."""
    buf = CarryBuffer(cap, packing_buffer)
    packed_batches, used, fills = [], [], []
    for step in range(n_packs):
        new = []
        while sum(buf.lengths) + sum(s.meta.encoded_len for s in new) < cap:
            new.append(new_segment())
        buf.insert(new)
        selected, stats = buf.take(step)
        fills.append(stats.fill)
        used += selected
        packed_batches.append(pack_segments(selected))
    return packed_batches, used, fills


def text_setup(args: argparse.Namespace, device: torch.device, rng: random.Random) -> dict:
    """Random-init Qwen2 and random text segments of log-normal lengths."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attn = pick_attn(args.attn, device)
    model = build_model(args.smoke, attn, device, dtype)
    vocab_size = model.config.vocab_size
    coords = CoordVocab.from_ids(range(vocab_size - 1000, vocab_size))
    mean_len, max_len = (80, 300) if args.smoke else (args.mean_len, args.max_len)
    lens = lognormal_lengths(
        rng, mean_len, args.sigma, max(8, args.min_len // (10 if args.smoke else 1)), max_len
    )
    sids = itertools.count()
    return dict(
        model=model, attn=attn, dtype=dtype, coord_ids=coords.ids, eos_id=2, pad_id=0, compact=None,
        new_segment=lambda: make_segment(rng, next(lens), vocab_size, coords, next(sids)),
    )  # fmt: skip


def vlm_setup(args: argparse.Namespace, device: torch.device, rng: random.Random) -> dict:
    """Qwen3-VL (tiny with ``--smoke``, else 2B shapes) and image segments through the learner's encoder."""
    from _vlm import build_vlm, forward_attention, image_messages, image_segment, image_sizes, write_images

    if args.attn not in ("auto", "sdpa"):
        raise SystemExit("--vlm runs the learner's attention (sdpa); --attn must be auto or sdpa")
    parts = build_vlm(args.smoke, device, train=True, gradient_checkpointing=args.gradient_checkpointing)
    index_deepstack(parts.model, enabled=args.index_deepstack)
    folder = Path(tempfile.mkdtemp(prefix="bench_packing_images_"))
    paths = write_images(folder, image_sizes(args.smoke), seed=args.seed)
    lo, hi = (20, 80) if args.smoke else (args.answer_min, args.answer_max)
    sids = itertools.count()

    def new_segment() -> Segment:
        sid = next(sids)
        prompt = parts.encoder.encode(image_messages(paths[rng.randrange(len(paths))]), index=sid)
        return image_segment(parts, prompt, rng.randint(lo, hi), rng, sid)

    return dict(
        model=parts.model, attn=forward_attention(parts.model),
        dtype=next(parts.model.parameters()).dtype, coord_ids=parts.coords.ids, eos_id=parts.eot_id,
        pad_id=parts.tokenizer.pad_token_id, compact=args.logits != "full", new_segment=new_segment,
        image_token_id=parts.image_token_id,
    )  # fmt: skip


def learner_step(
    model,
    b,
    coord_ids,
    eos_id: int,
    compact: bool | None,
    packed_kwargs: bool = False,
    *,
    varlen: bool | str = True,
    mark: Callable[[str], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward + loss + backward of one batch on the device, as the trainer's ``training_step``: forward and
    backward (checkpointing recomputes) under one attention set-up, the forward and loss the learner's
    ``micro_step_loss``. Returns ``(loss, logit columns)``; ``compact=None``: full logits under the model's
    own attention (the text bench as first recorded).
    ``varlen``: False = the per-segment loop; True or a ``model.varlen_kernel`` choice (``auto``, ``fa4``,
    ``torch``) = that varlen kernel where it runs."""
    kernel = varlen if isinstance(varlen, str) else "auto"
    # compact=None: full logits, the model's own attention (segment bounds passed where flash attends them).
    loss_cfg = LossConfig(
        compact_logits=bool(compact), segment_attention=compact is not None or packed_kwargs
    )
    with packed_attention(model, enabled=compact is not None, varlen=bool(varlen), kernel=kernel):
        step = micro_step_loss(
            model,
            b,
            coord_ids=coord_ids,
            eos_id=eos_id,
            loss_cfg=loss_cfg,
            after_forward=(lambda: mark("loss")) if mark else None,
        )
        if mark:
            mark("backward")
        step.loss.backward()
    return step.loss.detach(), step.columns


def train_tokens_per_s(
    model,
    batches,
    coord_ids,
    device,
    warmup: int,
    packed_kwargs: bool,
    *,
    eos_id: int = 2,
    compact: bool | None = None,
    varlen: bool | str = True,
    flop_model: FlopModel | None = None,
) -> tuple[float, dict]:
    """Real tokens / s of fwd + loss + bwd over ``batches`` (the first ``warmup`` untimed).

    ``compact=None``: full logits under the model's own attention (the text bench as first recorded);
    else the learner's step with ``compact`` logits. ``varlen``: packed rows attend through
    the varlen kernel where it runs (else the per-segment loop). With ``flop_model`` the info also holds the
    timed steps' model and attention FLOPs (``learner.flops``); on CUDA it holds the peak allocated memory.
    """
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tokens = 0
    slots = 0
    elapsed = 0.0
    model_flops = attn_flops = 0.0
    for i, batch in enumerate(batches):
        b = batch.to(device)
        sync()
        start = time.perf_counter()
        _, columns = learner_step(model, b, coord_ids, eos_id, compact, packed_kwargs, varlen=varlen)
        model.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            elapsed += time.perf_counter() - start
            tokens += b.num_tokens
            slots += int(b.input_ids.numel())
            if flop_model is not None:
                step = flop_model.batch_step(b, columns)
                model_flops += step.model
                attn_flops += step.attention
    info: dict = {"tokens": tokens, "slots": slots, "seconds": round(elapsed, 3)}
    if flop_model is not None:
        info |= {"model_flops": model_flops, "attn_flops": attn_flops}
    if cuda:
        info["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return tokens / elapsed, info


def interleaved(rounds: int, names: tuple[str, str], timed: Callable[[int], float]) -> dict:
    """``rounds`` interleaved timings ``timed(0)``, ``timed(1)`` (tokens/s of the same rows, side 0 / 1):
    both sides' tokens/s and the median, min and max of the per-round ratio (side 1 / side 0)."""
    speeds: list[list[float]] = [[], []]
    for _ in range(rounds):
        for side in (0, 1):
            speeds[side].append(timed(side))
    ratios = sorted(b / a for a, b in zip(*speeds, strict=True))
    return dict(rounds=rounds, **{f"tokens_per_s_{n}": [round(v) for v in speeds[i]] for i, n in
                enumerate(names)}, ratio_median=round(statistics.median(ratios), 4),
                ratio_min=round(ratios[0], 4), ratio_max=round(ratios[-1], 4))  # fmt: skip


def varlen_ran(model, batch, device, choice: bool | str = "auto") -> str | bool:
    """The varlen kernel a packed row of this model attends through here (`varlen_kernel`), else False."""
    dtype = next(model.parameters()).dtype
    choice = choice if isinstance(choice, str) else "auto"
    kernel = varlen_kernel(torch.empty(1, 1, 1, 128, device=device, dtype=dtype), choice=choice)
    return (kernel or False) if batch.packed else False


def guarded(mode: str, base: dict, fn: Callable[[], dict], **extra: object) -> None:
    """Emits ``fn()``'s record as ``mode``; an exception is emitted as the record's ``error`` (a diagnostic
    phase must not cost the run's other figures)."""
    try:
        emit(**(base | extra | {"mode": mode} | fn()))
    except Exception as err:  # noqa: BLE001 - reported, the bench goes on
        emit(**(base | extra | {"mode": mode, "error": f"{type(err).__name__}: {str(err)[:400]}"}))

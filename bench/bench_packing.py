"""Post-rollout packing benchmark (docs/ALGORITHM.md#packing). Prints one JSON object per line.

CPU (default): fill ratio of the carry buffer + §14.3 selection at steady state, for log-normal segment
lengths (mean ≈ 1100, max 4096) and rows of ``--packing-length`` tokens, over several inflow rates
(segments inserted per micro-step). Target: mean fill ≥ 0.95 once the inflow matches the row size.

GPU (``--gpu``): teacher-forced forward + backward throughput (real tokens / s) of a random-init
~0.5B Qwen2-architecture model in bf16, on the same segment stream run two ways:
  * padded: batches of ``--padded-batch`` segments, right-padded (``pad_segments``);
  * packed: the carry buffer fed until it holds ≥ one row of tokens, one ``select_segments`` row of
    ``--packing-length`` tokens per micro-step (``pack_segments``), no attention mask.
Attention: flash-attention-2 varlen when ``flash_attn`` is importable, else PyTorch flex-attention
(block-diagonal BlockMask from the position restarts), else sdpa (dense mask over the row); override
with ``--attn``. Target ratio packed / padded ≥ 1.9.

GPU with images (``--gpu --vlm``): the same comparison on a random-init Qwen3-VL-2B-shaped model (bf16, vision
tower included, gradient checkpointing only with ``--gradient-checkpointing``; ``bench/_vlm.py``) through the
learner's own path: image prompts of 448–896 px (196–784 image tokens) encoded by ``PromptEncoder`` (expanded
ids, ``pixel_values``, ``image_grid_thw``, M-RoPE positions), answers of 50–600 tokens turned into segments by
``build_segment``, rows of ``--packing-length`` (default 8192, the configs' value) packed / padded as above,
and every step the learner's ``micro_step_loss`` (compact logits unless ``--logits full``). Attention
is the learner's: ``sdpa`` as configured (flash-attn is not on the device image, Qwen3-VL takes no
flex-attention), which ``micro_step_loss`` runs per packed segment where it does so (``attn`` prints
``segment_sdpa``; on CUDA one varlen flash call per row, ``varlen: true``), else densely under transformers'
block-diagonal mask (``sdpa``). The ratio line also prints
the padding-free bound of the mix (padded slots / real tokens of the padded batches); target ≥ 2×, or ≥ 0.9 ×
the bound where the bound is below 2 (the vision tower's work is never padded, so the bound is not fully
reachable). With ``--vlm`` it also prints the MFU of every run (``learner.flops``, with the card's matmul
ceiling as ``mfu_bound``), peak memory, the same packed rows through the per-segment SDPA loop
(``packed_loop``, the attention before the varlen kernel) with the speed-up beside its bound and a loss /
gradient check of varlen vs loop (``--no-compare-loop`` skips them); ``--profile`` a torch.profiler breakdown
of one packed step each way (``bench/_step_profile.py``); ``--memory-sweep 8192 16384`` the peak memory of
such rows with and without gradient checkpointing; ``--compile vision|all`` last, regional torch.compile of
the ViT blocks (and the decoder layers), with ``--skip-eager`` only the compiled rows (lengths whose eager
step does not fit); ``--phases N`` the step's host / GPU span and idle per phase. ``--ddp`` under
torchrun: the data-parallel scaling of packed rows (1 GPU vs N, bound N). ``bench/mfu_gpu.sh`` runs the
device set.

Examples::

    python bench/bench_packing.py                      # CPU fill ratios
    python bench/bench_packing.py --gpu                # on a CUDA machine
    python bench/bench_packing.py --gpu --smoke        # tiny model, runs on CPU in seconds
    python bench/bench_packing.py --gpu --vlm          # Qwen3-VL-2B shapes, image segments (CUDA)
    python bench/bench_packing.py --gpu --vlm --smoke  # tiny Qwen3-VL on CPU
    torchrun --nproc_per_node 2 bench/bench_packing.py --gpu --vlm --ddp  # 2-GPU scaling
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _step_profile import (  # noqa: E402
    attention_replay,
    compare_varlen,
    matmul_ceiling_tflops,
    phase_split,
    profile_step,
)

from learner.batching.packing import CarryBuffer, pack_segments, pad_segments  # noqa: E402
from learner.flops import FlopModel, peak_tflops, utilization  # noqa: E402
from learner.kernels import (  # noqa: E402
    BLOCK_LISTS,
    apply_liger,
    compile_blocks,
    index_deepstack,
    packed_attention,
    varlen_kernel,
)
from learner.stage2.coords import CoordVocab  # noqa: E402
from learner.stage2.losses import LossConfig  # noqa: E402
from learner.stage2.step import micro_step_loss  # noqa: E402
from learner.stage2.targets.labels import build_labels  # noqa: E402
from learner.stage2.targets.segment import Segment, SegmentMeta  # noqa: E402


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def lognormal_lengths(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> Iterator[int]:
    """Endless log-normal lengths with the given mean, clipped to ``[lo, hi]``."""
    mu = math.log(mean) - sigma**2 / 2
    while True:
        yield max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


# ------------------------------------------------------------------------------------------------------------
# (a) CPU: fill ratio


class _LenOnly:
    """Minimal stand-in for a Segment: the carry buffer reads only ``meta``."""

    def __init__(self, length: int, step: int) -> None:
        self.meta = SegmentMeta(length, length, length, 1, (), 0, 0, (), (), (), (), step)


def run_fill(args: argparse.Namespace) -> None:
    mean_len = args.mean_len
    per_row = args.packing_length / mean_len
    for factor in args.inflow:
        rng = random.Random(args.seed)
        lens = lognormal_lengths(rng, mean_len, args.sigma, args.min_len, args.max_len)
        # Fractional inflow: carry the remainder so the mean is exactly factor * per_row segments.
        credit = 0.0
        buf = CarryBuffer(args.packing_length, args.packing_buffer)
        fills: list[float] = []
        overflow_at = None
        max_buffer = 0
        for step in range(args.steps):
            credit += factor * per_row
            n_new = int(credit)
            credit -= n_new
            try:
                buf.insert([_LenOnly(next(lens), step) for _ in range(n_new)])  # type: ignore[misc]
            except Exception as err:  # noqa: BLE001 - overflow is a result here, reported below
                overflow_at = f"step {step}: {type(err).__name__}"
                break
            segs, stats = buf.take(step)
            max_buffer = max(max_buffer, len(buf))
            if stats is not None and step >= args.warmup:
                fills.append(stats.fill)
        fills.sort()
        emit(
            bench="packing_fill",
            packing_length=args.packing_length,
            mean_len=mean_len,
            inflow_tokens_per_row=factor,
            segments_per_micro_step=round(factor * per_row, 2),
            steps=len(fills),
            fill_mean=round(statistics.fmean(fills), 4) if fills else None,
            fill_p10=round(fills[len(fills) // 10], 4) if fills else None,
            buffer_final=len(buf),
            buffer_max=max_buffer,
            overflow=overflow_at,
        )


# ------------------------------------------------------------------------------------------------------------
# (b) GPU: packed vs padded throughput


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


def run_gpu(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    rng = random.Random(args.seed)
    setup = (vlm_setup if args.vlm else text_setup)(args, device, rng)
    model, attn, dtype = setup["model"], setup["attn"], setup["dtype"]
    coord_ids = torch.tensor(setup["coord_ids"], device=device)
    cap = 1024 if args.smoke else args.packing_length
    steps = 3 if args.smoke else args.steps

    warmup = 2
    n_packs = steps + warmup
    packed_batches, used, fills = pack_stream(setup["new_segment"], cap, args.packing_buffer, n_packs)
    padded_batches = [
        pad_segments(used[i : i + args.padded_batch], setup["pad_id"])
        for i in range(0, len(used), args.padded_batch)
    ]
    pad_warmup = max(1, round(warmup * len(padded_batches) / n_packs))
    timed = padded_batches[pad_warmup:]
    bound = sum(int(b.input_ids.numel()) for b in timed) / sum(b.num_tokens for b in timed)

    base = dict(bench="packing_throughput",
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                attn=attn, dtype=str(dtype).removeprefix("torch."), smoke=args.smoke,
                params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                cudnn_sdpa=torch.backends.cuda.cudnn_sdp_enabled())  # fmt: skip
    if args.vlm:
        lengths = [s.meta.encoded_len for s in used]
        image_tokens = [s.input_ids.count(setup["image_token_id"]) for s in used]
        base |= dict(model="qwen3_vl", logits="compact" if setup["compact"] else "full",
                     gradient_checkpointing=bool(model.is_gradient_checkpointing), segments=len(used),
                     segment_len_mean=round(statistics.fmean(lengths)), segment_len_min=min(lengths),
                     segment_len_max=max(lengths), image_tokens_min=min(image_tokens),
                     image_tokens_max=max(image_tokens),
                     image_tokens_mean=round(statistics.fmean(image_tokens)))  # fmt: skip
    flash = attn.startswith("flash")
    cuda = device.type == "cuda"
    flop_model = FlopModel.from_model(model)
    peak = peak_tflops(base["device"], args.peak_tflops)
    ceiling = matmul_ceiling_tflops() if cuda else None
    params = sum(p.numel() for p in model.parameters())

    def perf(info: dict) -> dict:
        """MFU and friends of one timed run (`learner.flops`); ``mfu_6n_total`` is the issue's first
        estimate (6 × every parameter × language tokens); ``mfu_bound`` the card's matmul ceiling."""
        sums = {"perf/tokens": info["tokens"], "perf/model_flops": info.pop("model_flops"),
                "perf/attn_flops": info.pop("attn_flops")}  # fmt: skip
        out = {
            k.removeprefix("perf/"): round(v, 4)
            for k, v in utilization(sums, info["seconds"], 1, peak).items()
            if k != "perf/tokens_per_s"  # printed as the run's own tokens_per_s
        }
        if peak:
            out["mfu_6n_total"] = round(6 * params * info["tokens"] / info["seconds"] / 1e12 / peak, 4)
            out["peak_tflops"] = peak
            if ceiling:
                out["mfu_bound"] = round(ceiling / peak, 4)
        return out

    run = dict(eos_id=setup["eos_id"], compact=setup["compact"], flop_model=flop_model)
    varlen = args.varlen_kernel if not args.attn_loop else False
    packed_tps = None
    if not args.skip_eager:
        padded_tps, padded_info = train_tokens_per_s(
            model, padded_batches, coord_ids, device, pad_warmup, False, varlen=varlen, **run
        )
        emit(**base, mode="padded", batch=args.padded_batch, tokens_per_s=round(padded_tps, 1),
             pad_fraction=round(1 - padded_info["tokens"] / padded_info["slots"], 4), **perf(padded_info),
             **padded_info)  # fmt: skip
        packed_tps, packed_info = train_tokens_per_s(
            model, packed_batches, coord_ids, device, warmup, flash, varlen=varlen, **run
        )
        packed_perf = perf(packed_info)
        ran = varlen and _varlen_ran(model, packed_batches[0], device, varlen)
        emit(**base, mode="packed", packing_length=cap, tokens_per_s=round(packed_tps, 1),
             fill_mean=round(statistics.fmean(fills), 4), varlen=ran, **packed_perf,
             **packed_info)  # fmt: skip
        ratio = packed_tps / padded_tps
        if args.vlm:  # ≥ 2x, or ≥ 90 % of the padding-free bound where the bound is below 2
            target = 2.0 if bound >= 2.0 else round(0.9 * bound, 3)
            emit(**base, mode="ratio", packed_over_padded=round(ratio, 3), padding_free_bound=round(bound, 3),
                 ratio_over_bound=round(ratio / bound, 3), target=target, met=ratio >= target)  # fmt: skip
        else:
            emit(
                **base,
                mode="ratio",
                packed_over_padded=round(ratio, 3),
                padding_free_bound=round(bound, 3),
                target=1.9,
            )
    if not args.vlm:
        return
    step_args = (coord_ids, setup["eos_id"], setup["compact"])

    def step(batch, varlen: bool | str = varlen, mark: Callable[[str], None] | None = None) -> torch.Tensor:
        return learner_step(model, batch.to(device), *step_args, varlen=varlen, mark=mark)[0]

    if args.compare_loop and varlen:  # the same packed rows through the per-segment loop: the "before"
        loop_tps, loop_info = train_tokens_per_s(
            model, packed_batches, coord_ids, device, warmup, flash, varlen=False, **run
        )
        loop_perf = perf(loop_info)
        emit(**base, mode="packed_loop", tokens_per_s=round(loop_tps, 1), **loop_perf, **loop_info)
        speedup_bound = (loop_perf.get("mfu_bound") or 0) / loop_perf["mfu"] if loop_perf.get("mfu") else None
        emit(**base, mode="varlen_over_loop", speedup=round(packed_tps / loop_tps, 3),
             bound=round(speedup_bound, 3) if speedup_bound else None,
             bound_is="matmul-ceiling MFU / loop MFU")  # fmt: skip
        _guarded("varlen_check", base, lambda: compare_varlen(model, packed_batches[0], step))
    if args.attn_replay:  # one row's attention calls through each kernel that runs here (blocks still eager)
        row = packed_batches[0].to(device)
        _guarded("attn_replay", base, lambda: attention_replay(step, row, args.attn_replay))
    if args.profile:  # the step as run above, and the per-segment loop (the "before") where compared
        kernels = ("varlen", "loop") if varlen and args.compare_loop else ("varlen" if varlen else "loop",)
        for kernel in kernels:
            table = f"{args.profile_table}.{kernel}.txt" if args.profile_table else None
            path = functools.partial(step, varlen=kernel == "varlen")
            _guarded("profile", base, lambda p=path, t=table: profile_step(p, packed_batches[1], model, t),
                     attention=kernel)  # fmt: skip
    for length in args.memory_sweep:
        rows = pack_stream(setup["new_segment"], length, args.packing_buffer, 2)[0]
        for checkpointing in (False, True):
            measure = lambda rows=rows, c=checkpointing: _memory(model, rows, c, device, coord_ids, run)  # noqa: E731
            _guarded("memory", base, measure, packing_length=length, gradient_checkpointing=checkpointing)
    if args.liger:  # last: the patch cannot be undone; the same packed rows, loss of the first row compared
        loss_before = float(step(packed_batches[0]).detach())
        model.zero_grad(set_to_none=True)
        patched = apply_liger(model)
        liger_tps, liger_info = train_tokens_per_s(
            model, packed_batches, coord_ids, device, warmup, flash, varlen=varlen, **run
        )
        loss_after = float(step(packed_batches[0]).detach())
        model.zero_grad(set_to_none=True)
        emit(**base, mode="packed_liger", patched=patched, tokens_per_s=round(liger_tps, 1),
             speedup=round(liger_tps / packed_tps, 3), loss_before=round(loss_before, 5),
             loss_after=round(loss_after, 5), **perf(liger_info), **liger_info)  # fmt: skip
        if args.profile:  # where the patched step's time goes (the next lever after Liger)
            table = f"{args.profile_table}.liger.txt" if args.profile_table else None
            _guarded("profile", base, lambda: profile_step(step, packed_batches[1], model, table),
                     attention="varlen+liger")  # fmt: skip
    if args.compile:  # last (after Liger where given): compiled blocks cannot be undone either
        compiled = {}
        _guarded("packed_compiled", base, lambda: compiled.setdefault("info", _compiled_phase(
            args, model, packed_batches, warmup, step, coord_ids, device, flash, varlen, run, perf,
            liger_tps if args.liger else packed_tps)))  # fmt: skip
        for options in args.inductor_options if "info" in compiled else []:
            _guarded("packed_compiled_tuned", base, lambda o=options: _tuned_phase(
                json.loads(o), args, model, packed_batches, warmup, coord_ids, device, flash, varlen, run,
                perf, compiled["info"]))  # fmt: skip
    if args.ab_kernel and cuda:  # the varlen kernels against each other on the same rows
        _guarded("ab_kernel", base, lambda: _ab_kernel(args.ab_kernel, packed_batches, step, model, device))
    if args.ab_copy and cuda:  # the batch's host -> GPU copy inside the step, as the trainer has it
        _guarded("ab_copy", base, lambda: _ab_copy(args.ab_copy, packed_batches, step, model, device))
    if args.phases:  # where the step's GPU idle sits (the compiled step with --compile)
        rows = [b.to(device) for b in packed_batches[: args.phases + 1]]
        _guarded("phases", base, lambda: phase_split(step, rows, model),
                 attention=f"varlen+compile-{args.compile}" if args.compile else "varlen")  # fmt: skip
    if args.compile:
        if args.profile:
            table = f"{args.profile_table}.compiled.txt" if args.profile_table else None
            _guarded("profile", base, lambda: profile_step(step, packed_batches[1], model, table),
                     attention=f"varlen{'+liger' if args.liger else ''}+compile-{args.compile}")  # fmt: skip


def _compiled_phase(args, model, rows, warmup, step, coord_ids, device, flash, varlen, run, perf, before_tps):
    """The same packed rows once ``compile_blocks`` compiled the model's blocks: every row once untimed (the
    compilation and any recompile happen there), then the timed rows of the other phases. Returns tokens/s,
    the speed-up over ``before_tps`` (the previous phase), the first row's loss before and after, the
    seconds of the first compiled row (compilation) and dynamo's graph / graph-break counts."""
    from torch._dynamo.utils import counters

    loss_before = None
    if before_tps is not None:  # no eager step where it would not fit (--skip-eager)
        loss_before = float(step(rows[0]).detach())
        model.zero_grad(set_to_none=True)
    lists = ("visual.blocks",) if args.compile == "vision" else BLOCK_LISTS
    compiled = compile_blocks(model, lists)
    start = time.perf_counter()
    loss_after = float(step(rows[0]).detach())
    model.zero_grad(set_to_none=True)
    first_row_s = time.perf_counter() - start
    tps, info = train_tokens_per_s(model, rows + rows[warmup:], coord_ids, device, len(rows), flash,
                                   varlen=varlen, **run)  # fmt: skip
    if args.ab_deepstack:  # interleaved rounds, transformers' deepstack merge vs the index form

        def timed(indexed: int) -> float:
            index_deepstack(model, enabled=bool(indexed))
            return train_tokens_per_s(model, rows, coord_ids, device, 1, flash, varlen=varlen, **run)[0]

        emit(mode="ab_deepstack", **_interleaved(args.ab_deepstack, ("mask", "index"), timed))
        index_deepstack(model, enabled=args.index_deepstack)
    return dict(compiled=args.compile, compiled_blocks=compiled, index_deepstack=args.index_deepstack,
                tokens_per_s=round(tps, 1),
                speedup=round(tps / before_tps, 3) if before_tps else None,
                loss_before=round(loss_before, 5) if loss_before is not None else None,
                loss_after=round(loss_after, 5), first_row_s=round(first_row_s, 1),
                graphs=int(counters["stats"]["unique_graphs"]),
                graph_breaks=int(sum(counters["graph_break"].values())),
                **perf(info), **info)  # fmt: skip


def _ab_kernel(rounds: int, rows: list, step: Callable, model, device: torch.device) -> dict:
    """The packed rows through PyTorch's varlen op (FlashAttention-2) vs FlashAttention-4
    (``model.varlen_kernel`` torch / fa4), ``rounds`` interleaved rounds after one untimed pass each (FA4's
    kernels compile on first use; compiled blocks recompile once per kernel). The ratio is fa4 / torch; the
    loss of row 0 both ways. Raises where FA4 does not run here (the record says why)."""
    dtype = next(model.parameters()).dtype
    if varlen_kernel(torch.empty(1, 1, 1, 128, device=device, dtype=dtype), choice="fa4") != "fa4":
        raise RuntimeError("FA4 does not run here (flash-attn-4 not importable, not SM 9.x/10.x, or failed)")
    kernels = ("torch", "fa4")
    rows = [r.to(device) for r in rows]
    tokens = sum(r.num_tokens for r in rows)

    def run(kernel: str, read_loss: bool = False) -> tuple[float | None, float]:
        """All rows once through ``kernel``: (loss of row 0 where ``read_loss``, a host sync; seconds)."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = None
        for i, row in enumerate(rows):
            out = step(row, varlen=kernel)
            if read_loss and i == 0:
                loss = float(out.detach())
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return loss, time.perf_counter() - start

    first = {kernel: run(kernel, read_loss=True) for kernel in kernels}
    record = _interleaved(rounds, kernels, lambda side: tokens / run(kernels[side])[1])
    for kernel, (loss, seconds) in first.items():
        record |= {f"loss_{kernel}": round(loss, 5), f"first_pass_s_{kernel}": round(seconds, 1)}
    return record | dict(rows=len(rows))


def _ab_copy(rounds: int, rows: list, step: Callable, model, device: torch.device) -> dict:
    """The rows back to back with their host -> GPU copy inside the timing, as the trainer's micro-steps run
    (no sync between them): copied from pageable memory (blocking: the host waits for the previous step's
    backward, then the GPU for the copy) vs from page-locked memory with ``non_blocking`` (what the
    planner's ``pin_memory`` builds). ``rounds`` interleaved rounds; the ratio is pinned / pageable."""
    sides = ((rows, False), ([r.pin_memory() for r in rows], True))  # pinned: as the planner builds them
    tokens = sum(r.num_tokens for r in rows)
    losses = []
    for src, nb in sides:
        losses.append(float(step(src[0].to(device, non_blocking=nb)).detach()))
        model.zero_grad(set_to_none=True)

    def timed(side: int) -> float:
        src, nb = sides[side]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for row in src:
            step(row.to(device, non_blocking=nb))
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return tokens / (time.perf_counter() - start)

    return _interleaved(rounds, ("pageable", "pinned"), timed) | dict(
        rows=len(rows), loss_pageable=round(losses[0], 5), loss_pinned=round(losses[1], 5)
    )


def _interleaved(rounds: int, names: tuple[str, str], timed: Callable[[int], float]) -> dict:
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


def _tuned_phase(
    options: dict, args, model, rows, warmup, coord_ids, device, flash, varlen, run, perf, compiled: dict
) -> dict:
    """The compiled rows again with the blocks recompiled under Inductor ``options`` (e.g.
    ``{"coordinate_descent_tuning": true}``: block sizes of the fused kernels tuned; ``"max_autotune"``:
    matmuls and fused kernels benchmarked against Triton templates): every row once untimed (compilation and
    tuning), then the timed rows; tokens/s, its ratio over the plain compiled phase, the seconds the tuning
    took."""
    lists = ("visual.blocks",) if args.compile == "vision" else BLOCK_LISTS
    compile_blocks(model, lists, options=options)
    start = time.perf_counter()
    tps, info = train_tokens_per_s(model, rows + rows[warmup:], coord_ids, device, len(rows), flash,
                                   varlen=varlen, **run)  # fmt: skip
    return dict(inductor_options=options, tokens_per_s=round(tps, 1),
                speedup=round(tps / compiled["tokens_per_s"], 3),
                seconds_with_tuning=round(time.perf_counter() - start, 1), **perf(info), **info)  # fmt: skip


def run_ddp(args: argparse.Namespace) -> None:
    """Data-parallel scaling of packed training (``torchrun --nproc_per_node N ... --ddp``): every rank builds
    the same model and its own segment stream (seed + rank); rank 0 first times its packed rows ALONE (the
    others wait), then all ranks time theirs under DistributedDataParallel. Prints the 1-GPU and the N-GPU
    tokens/s (all ranks) and their ratio beside its bound N (target ≥ 0.9 N)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.vlm and rank == 0:  # ranks building the shared tiny model folder side by side race
        from _vlm import tiny_vlm_dir

        tiny_vlm_dir()
    dist.barrier()
    setup = (vlm_setup if args.vlm else text_setup)(args, device, random.Random(args.seed + rank))
    model = setup["model"]
    coord_ids = torch.tensor(setup["coord_ids"], device=device)
    cap = 1024 if args.smoke else args.packing_length
    steps, warmup = (3 if args.smoke else args.steps), 2
    rows = pack_stream(setup["new_segment"], cap, args.packing_buffer, steps + warmup)[0]
    run = dict(eos_id=setup["eos_id"], compact=setup["compact"], flop_model=FlopModel.from_model(model))
    single = None
    if rank == 0:
        single = train_tokens_per_s(model, rows, coord_ids, device, warmup, False, **run)[0]
    dist.barrier()
    ddp = DistributedDataParallel(model, device_ids=[local] if cuda else None)
    tps, info = train_tokens_per_s(ddp, rows, coord_ids, device, warmup, False, **run)
    totals = torch.tensor([info["tokens"], info["seconds"]], dtype=torch.float64, device=device)
    seconds = totals[1:].clone()
    dist.all_reduce(totals[:1])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        aggregate = float(totals[0]) / float(seconds[0])
        emit(bench="packing_ddp", device=torch.cuda.get_device_name() if cuda else "cpu", ranks=world,
             vlm=args.vlm, smoke=args.smoke, packing_length=cap, single_tokens_per_s=round(single, 1),
             ddp_tokens_per_s=round(aggregate, 1), rank0_tokens_per_s=round(tps, 1),
             scaling=round(aggregate / single, 3), bound=world, target=round(0.9 * world, 2),
             met=aggregate / single >= 0.9 * world)  # fmt: skip
    dist.destroy_process_group()


def _varlen_ran(model, batch, device, choice: bool | str = "auto") -> str | bool:
    """The varlen kernel a packed row of this model attends through here (`varlen_kernel`), else False."""
    dtype = next(model.parameters()).dtype
    choice = choice if isinstance(choice, str) else "auto"
    kernel = varlen_kernel(torch.empty(1, 1, 1, 128, device=device, dtype=dtype), choice=choice)
    return (kernel or False) if batch.packed else False


def _memory(model, rows, checkpointing: bool, device, coord_ids, run: dict) -> dict:
    """Peak allocated memory (GiB) and tokens/s of the second of two packed rows, checkpointing on or off."""
    was = model.is_gradient_checkpointing
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    try:
        tps, info = train_tokens_per_s(model, rows, coord_ids, device, 1, False, **run)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"oom": True}
    finally:
        (model.gradient_checkpointing_enable if was else model.gradient_checkpointing_disable)()
    return {"tokens": info["tokens"], "tokens_per_s": round(tps, 1), "peak_mem_gib": info.get("peak_mem_gib")}


def _guarded(mode: str, base: dict, fn: Callable[[], dict], **extra: object) -> None:
    """Emits ``fn()``'s record as ``mode``; an exception is emitted as the record's ``error`` (a diagnostic
    phase must not cost the run's other figures)."""
    try:
        emit(**(base | extra | {"mode": mode} | fn()))
    except Exception as err:  # noqa: BLE001 - reported, the bench goes on
        emit(**(base | extra | {"mode": mode, "error": f"{type(err).__name__}: {str(err)[:400]}"}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="throughput benchmark (packed vs padded)")
    p.add_argument("--smoke", action="store_true", help="tiny model and lengths (runs on CPU)")
    p.add_argument("--vlm", action="store_true", help="with --gpu: Qwen3-VL and image segments (see above)")
    p.add_argument(
        "--logits",
        choices=["compact", "full"],
        default="compact",
        help="--vlm: the step's logits (stage2.loss.compact_logits)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="--vlm: turn gradient checkpointing on (default off)",
    )
    p.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="diagnostic: disable PyTorch's cuDNN SDPA backend (it builds one graph per new sequence length)",
    )
    p.add_argument(
        "--attn-loop",
        action="store_true",
        help="--vlm: packed rows attend per segment in a Python loop (the attention before varlen)",
    )
    p.add_argument(
        "--no-compare-loop",
        dest="compare_loop",
        action="store_false",
        help="--vlm: skip timing the same packed rows through the per-segment loop (and the varlen check)",
    )
    p.add_argument(
        "--profile", action="store_true", help="--vlm: torch.profiler breakdown of one packed step"
    )
    p.add_argument("--profile-table", default=None, help="--profile: op tables to PREFIX.{varlen,loop}.txt")
    p.add_argument(
        "--memory-sweep",
        type=int,
        nargs="*",
        default=[],
        help="--vlm: packing lengths whose peak step memory to measure, checkpointing off / on",
    )
    p.add_argument(
        "--compile",
        choices=["vision", "all"],
        default=None,
        help="--vlm: last, the same packed rows with regional torch.compile of the ViT blocks (vision) or of"
        " them and the decoder layers (all)",
    )
    p.add_argument(
        "--inductor-options",
        nargs="*",
        default=[],
        metavar="JSON",
        help="--compile: then per JSON (e.g. '{\"coordinate_descent_tuning\": true}') the blocks recompiled"
        " with those Inductor options and the same rows timed",
    )
    p.add_argument(
        "--skip-eager",
        action="store_true",
        help="--compile: no eager timing (padded, packed, the loss before): only the compiled rows, for"
        " lengths whose eager step does not fit (with a memory cap)",
    )
    p.add_argument(
        "--varlen-kernel",
        default="auto",
        choices=("auto", "fa4", "torch"),
        help="packed rows' varlen attention kernel (model.varlen_kernel): auto = FA4 where it runs, else"
        " torch",
    )
    p.add_argument(
        "--ab-kernel",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="CUDA: then ROUNDS interleaved timings of the packed rows, varlen kernel torch (FA2) vs fa4",
    )
    p.add_argument(
        "--attn-replay",
        type=int,
        default=0,
        metavar="REPS",
        help="--vlm: the attention calls of one packed row replayed through each varlen kernel that runs here"
        " and the per-segment loop, REPS timings each (bench/_step_profile.py attention_replay)",
    )
    p.add_argument(
        "--ab-copy",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="CUDA: then ROUNDS interleaved timings of the packed rows back to back with their host -> GPU"
        " copy inside: from pageable memory vs pinned + non_blocking (the planner's pin_memory)",
    )
    p.add_argument(
        "--ab-deepstack",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="--compile: then ROUNDS interleaved timings of the compiled rows, deepstack by mask / by index",
    )
    p.add_argument(
        "--phases",
        type=int,
        default=0,
        metavar="ROWS",
        help="--vlm: last, the step (compiled with --compile) cut into phases over ROWS rows: host and GPU"
        " span, kernel time and GPU idle of each (bench/_step_profile.py phase_split)",
    )
    p.add_argument(
        "--index-deepstack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--vlm: the deepstack merge as an index_add, as the learner loads Qwen3-VL"
        " (learner.kernels.index_deepstack); --no-index-deepstack: transformers' boolean-mask merge",
    )
    p.add_argument(
        "--liger", action="store_true", help="--vlm: then the same packed rows with Liger-Kernel's patches"
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU dense bf16 peak (default: table)")
    p.add_argument(
        "--ddp",
        action="store_true",
        help="under torchrun: packed rows on every rank, alone on rank 0 then under DDP (scaling)",
    )
    p.add_argument("--answer-min", type=int, default=50, help="--vlm: shortest answer (tokens)")
    p.add_argument("--answer-max", type=int, default=600, help="--vlm: longest answer (tokens)")
    p.add_argument("--cpu", action="store_true", help="force the throughput benchmark onto the CPU")
    p.add_argument("--attn", default="auto", help="auto | flash_attention_2 | flex_attention | sdpa | eager")
    p.add_argument("--packing-length", type=int, default=None, help="16384 (--vlm: 8192)")
    p.add_argument("--packing-buffer", type=int, default=512)
    p.add_argument("--padded-batch", type=int, default=4)
    p.add_argument("--mean-len", type=float, default=1100.0)
    p.add_argument("--sigma", type=float, default=0.6, help="log-normal shape of the segment lengths")
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument(
        "--steps", type=int, default=None, help="fill: micro-steps (2000); gpu: timed packed rows (20)"
    )
    p.add_argument("--warmup", type=int, default=100, help="fill: micro-steps ignored at the start")
    p.add_argument("--inflow", type=float, nargs="+", default=[0.9, 0.95, 1.0, 1.05],
                   help="fill: segments per micro-step as a multiple of"
                        " packing_length / mean_len")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.packing_length is None:
        args.packing_length = 8192 if args.vlm else 16384
    if args.vlm and not args.gpu:
        p.error("--vlm goes with --gpu (the fill benchmark does not depend on the model)")
    if args.gpu:
        args.steps = args.steps or 20
        (run_ddp if args.ddp else run_gpu)(args)
    else:
        args.steps = args.steps or 2000
        run_fill(args)


if __name__ == "__main__":
    main()
